#!/usr/bin/env bash
# One device call (~6 min) for the paged MoE worker at several input rows (moe_pages=N):
#   1. the tiny parity (1-16 rows), long-split, North per-layer and watchdog GPU tests under $ALSO_TUNING (default
#      moe_pages=16,moe_pages_from=1,moe_pages_max=6: every plan paged, a ring that wraps);
#   2. the step at $POINTS under $VARIANTS, one process;
#   3. a timeline at $TRACE_POINT under $TRACE_TUNING (summary only; SKIP_TRACE=1 skips).
# Everything comes back in $OUT/bundle.tgz.
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_pages_rows_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
POINTS=${POINTS:-8x8192,1x8192,2x8192,4x8192,16x8192}
VARIANTS=${VARIANTS:-"default moe_pages=8 default moe_pages=8"}
ALSO_TUNING=${ALSO_TUNING:-moe_pages=16,moe_pages_from=1,moe_pages_max=6}
TRACE_POINT=${TRACE_POINT:-8x8192}
TRACE_TUNING=${TRACE_TUNING:-}
t0=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  echo "commit ${MEGAKERNEL_COMMIT:-unknown}"; } | tee "$OUT/env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "=== tests under $ALSO_TUNING"
  MEGAKERNEL_MK_TUNING=$ALSO_TUNING timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -x -m gpu -p no:cacheprovider \
    tests/kernel/test_gpu.py tests/kernel/test_gpu_north.py -k "${TESTS_K:-tiny or long_splits or north or watchdog}" \
    2>&1 | tee "$OUT/tests_pages.log" | tail -3
fi
echo "=== variants at $(($(date +%s) - t0)) s"
timeout ${VARIANTS_TIMEOUT:-200} python3 benchmarks/megakernel_variants.py --points "$POINTS" \
  --variants "$(echo $VARIANTS)" --steps 40 --json "$OUT/variants_pages.json" 2>&1 | grep -E "^b|rror"
if [ "${SKIP_TRACE:-0}" != 1 ]; then
  bsz=${TRACE_POINT%x*}; ctx=${TRACE_POINT#*x}
  echo "=== trace b$bsz $ctx under $TRACE_TUNING at $(($(date +%s) - t0)) s"
  MEGAKERNEL_MK_TUNING=$TRACE_TUNING timeout ${TRACE_TIMEOUT:-100} python3 -m megakernel bench --random-north \
    --backend megakernel --batch-size $bsz --context $ctx --steps 20 --trace "$OUT/tl_b$bsz.npz" 2>&1 \
    | grep -E "critical|SM time|phases|a layer|MoE workers|normal build|rror"
  rm -f "$OUT/tl_b$bsz.npz"
fi
echo "=== done at $(($(date +%s) - t0)) s"
bash scripts/pack_out.sh "$OUT"
