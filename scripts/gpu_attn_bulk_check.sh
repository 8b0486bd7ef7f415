#!/usr/bin/env bash
# One device call (~6 min) for attention's K/V loading (MK_ATTN_BULK: 0 cp.async, 1 one bulk copy per row, 2 tensor
# copies of 16-key boxes through maps of the KV pools), each build in its own process:
#   1. under MK_ATTN_BULK=$TEST_BUILD: the tiny / long-split / 16-token-block attention tests and the North per-layer
#      acceptance (its attention takes the tensor path at build 2);
#   2. the step at $POINTS for each build in $BUILDS (default "2 0"), two runs each;
#   3. a b1 timeline at 8K under MK_ATTN_BULK=$TEST_BUILD (summary only).
# Everything comes back in $OUT/bundle.tgz.
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_attn_bulk_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
POINTS=${POINTS:-1x8192,8x8192,1x131072}
BUILDS=${BUILDS:-"2 0"}
TEST_BUILD=${TEST_BUILD:-2}
t0=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  echo "commit ${MEGAKERNEL_COMMIT:-unknown}"; } | tee "$OUT/env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "=== tests, MK_ATTN_BULK=$TEST_BUILD"
  MEGAKERNEL_KERNEL_DEFINES=MK_ATTN_BULK=$TEST_BUILD timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -x -m gpu \
    -p no:cacheprovider tests/kernel/test_gpu.py tests/kernel/test_gpu_north.py \
    -k "tiny or long_splits or 16_token or north" 2>&1 | tee "$OUT/tests_bulk$TEST_BUILD.log" | tail -3
fi
for b in $BUILDS; do
  echo "=== MK_ATTN_BULK=$b at $POINTS, $(($(date +%s) - t0)) s"
  MEGAKERNEL_KERNEL_DEFINES=MK_ATTN_BULK=$b timeout ${VARIANTS_TIMEOUT:-100} python3 benchmarks/megakernel_variants.py \
    --points "$POINTS" --variants "default default" --steps 40 --json "$OUT/variants_bulk$b.json" 2>&1 \
    | grep -E "^b|rror"
done
if [ "${SKIP_TRACE:-0}" != 1 ]; then
  echo "=== trace b1 8K, MK_ATTN_BULK=$TEST_BUILD, at $(($(date +%s) - t0)) s"
  MEGAKERNEL_KERNEL_DEFINES=MK_ATTN_BULK=$TEST_BUILD timeout ${TRACE_TIMEOUT:-90} python3 -m megakernel bench \
    --random-north --backend megakernel --batch-size 1 --context 8192 --steps 20 --trace "$OUT/tl_b1.npz" 2>&1 \
    | grep -E "critical|SM time|a layer|normal build|rror"
  rm -f "$OUT/tl_b1.npz"
fi
echo "=== done at $(($(date +%s) - t0)) s"
bash scripts/pack_out.sh "$OUT"
