#!/usr/bin/env bash
# One device call of the speed loop: the megakernel's knob sweep (benchmarks/megakernel_variants.py), every
# gpu-marked test, the prefill bench up to 32K with the stream gap, and (if present) the prefill-attention tuner;
# on request the SM timeline of batch 1 at 8K (trace), compute-sanitizer memcheck + racecheck on a tiny config
# (sanitizer) and the GEMV streaming microbenchmark (stream: benchmarks/gemv_stream.py). Logs and JSON under $OUT.
# STAGES picks: variants tests prefill tune trace sanitizer stream (default: the first four).
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_dev_loop.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python3 -c 'import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)';
  echo "commit ${MEGAKERNEL_COMMIT:-unknown}"; } | tee "$OUT/env.txt"
t0=$(date +%s)
for s in ${STAGES:-variants tests prefill tune}; do
  echo "=== $s at $(($(date +%s) - t0)) s"
  case $s in
    variants) timeout ${VARIANTS_TIMEOUT:-200} python3 benchmarks/megakernel_variants.py \
        --points ${POINTS:-1x8192,8x8192,1x32768} --variants "${VARIANTS:-default}" --steps 30 \
        --json "$OUT/variants.json" 2>&1 | tee "$OUT/variants.log" | grep -vE "^\s*$|Warning" | tail -20 ;;
    tests) timeout ${TESTS_TIMEOUT:-280} python3 -m pytest -q -rfE -m gpu ${PYTEST_FLAGS:--x} ${TESTS:-tests} 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -25 ;;
    prefill) timeout ${PREFILL_TIMEOUT:-150} python3 -m megakernel bench --prefill --max-context ${PREFILL_MAX:-32768} \
        --json "$OUT/prefill.json" 2>&1 | tee "$OUT/prefill.log" | grep -E "prefill|gap|Error|error" ;;
    trace) timeout ${TRACE_TIMEOUT:-150} python3 -m megakernel bench --random-north --backend megakernel --batch-size 1 \
        --context 8192 --steps 20 --trace "$OUT/tl_b1.json.gz" 2>&1 | tee "$OUT/trace.log" | grep -vE "^\s*$" | tail -24 ;;
    sanitizer) OUT=$OUT bash scripts/gpu_kernel_check.sh sanitizer 2>&1 | tail -30 ;;
    stream) timeout ${STREAM_TIMEOUT:-90} python3 benchmarks/gemv_stream.py --json "$OUT/gemv_stream.json" 2>&1 \
        | tee "$OUT/gemv_stream.log" | tail -40 ;;
    tune) [ -f benchmarks/prefill_attention_tune.py ] && timeout ${TUNE_TIMEOUT:-120} python3 \
        benchmarks/prefill_attention_tune.py --json "$OUT/prefill_tune.json" 2>&1 | tee "$OUT/prefill_tune.log" | tail -20 ;;
  esac
done
echo "=== done at $(($(date +%s) - t0)) s"
bash scripts/pack_out.sh "$OUT"
