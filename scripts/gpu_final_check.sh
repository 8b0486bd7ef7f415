#!/usr/bin/env bash
# The end-of-session device call: the decode sweep (megakernel and graph backends in one run), then every gpu-marked
# test, then compute-sanitizer's memcheck and racecheck on the megakernel; logs and JSON under $OUT.
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_final_check.sh", timeout_s=600)
#   (<SHA>: this checkout's `git rev-parse --short HEAD`, typed literally: the device copy's .git may lag the tree.)
# Optional: VARIANTS="default knob=v ..." (at VARIANT_POINTS, one process) and TRACE=1 (the b1 8K timeline summary).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
t0=$(date +%s)
OUT=$OUT BACKENDS=${BACKENDS:-megakernel,graph} SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-300} bash scripts/gpu_decode_sweep.sh \
  | grep -E "ms/step|/ graph|rror" | tail -24
echo "=== gpu tests at $(($(date +%s) - t0)) s"
timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" \
  | grep -E "passed|failed|Error" | tail -5
echo "=== sanitizer at $(($(date +%s) - t0)) s"
OUT=$OUT bash scripts/gpu_kernel_check.sh sanitizer > /dev/null 2>&1
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|rc=" "$OUT/log.txt" | tail -6; mv "$OUT/log.txt" "$OUT/sanitizer.log"
if [ -n "${VARIANTS:-}" ]; then       # optional: knob A/Bs in one process at $VARIANT_POINTS
  echo "=== variants at $(($(date +%s) - t0)) s"
  timeout ${VARIANTS_TIMEOUT:-120} python3 benchmarks/megakernel_variants.py --points "${VARIANT_POINTS:-1x8192}" \
    --variants "$VARIANTS" --steps 40 --json "$OUT/variants.json" 2>&1 | grep -E "^b|rror"
fi
if [ "${TRACE:-0}" = 1 ]; then        # optional: the b1 8K SM timeline's summary
  echo "=== trace b1 at $(($(date +%s) - t0)) s"
  timeout ${TRACE_TIMEOUT:-90} python3 -m megakernel bench --random-north --backend megakernel --batch-size 1 \
    --context 8192 --steps 20 --trace "$OUT/tl_b1.npz" 2>&1 | grep -E "critical|SM time|phases|a layer|normal build|rror"
  rm -f "$OUT/tl_b1.npz"
fi
echo "=== done at $(($(date +%s) - t0)) s"
bash scripts/pack_out.sh "$OUT"
