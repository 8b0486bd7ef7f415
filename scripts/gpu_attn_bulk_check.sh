#!/usr/bin/env bash
# One device call (~6 min) for attention's bulk-copy K/V ring (MK_ATTN_BULK, default 1) against the 16-byte cp.async
# ring (MK_ATTN_BULK=0, its own build and process): 1. the attention / tiny / North per-layer GPU tests under the
# default build; 2. the step at $POINTS, default build; 3. the same under MEGAKERNEL_KERNEL_DEFINES=MK_ATTN_BULK=0;
# 4. the three-stage build (MEGAKERNEL_ATTN_MAX_STAGES=3): its ring test, then attn_stages=2 and 3 at $POINTS;
# 5. a b1 timeline at 8K of the default build (summary only). Everything comes back in $OUT/bundle.tgz.
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_attn_bulk_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
POINTS=${POINTS:-1x8192,8x8192,1x32768,1x131072}
t0=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  echo "commit ${MEGAKERNEL_COMMIT:-unknown}"; } | tee "$OUT/env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "=== tests, default build"
  timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/kernel/test_gpu.py \
    tests/kernel/test_gpu_north.py -k "tiny or long_splits or attn or north" 2>&1 | tee "$OUT/tests_default.log" | tail -3
fi
echo "=== default build at $POINTS, $(($(date +%s) - t0)) s"
timeout ${VARIANTS_TIMEOUT:-100} python3 benchmarks/megakernel_variants.py --points "$POINTS" \
  --variants "default default" --steps 40 --json "$OUT/variants_default_build.json" 2>&1 | grep -E "^b|rror"
echo "=== MK_ATTN_BULK=0 build at $(($(date +%s) - t0)) s"
MEGAKERNEL_KERNEL_DEFINES=MK_ATTN_BULK=0 timeout ${VARIANTS_TIMEOUT:-100} python3 benchmarks/megakernel_variants.py \
  --points "$POINTS" --variants "default default" --steps 40 --json "$OUT/variants_cpasync_build.json" 2>&1 \
  | grep -E "^b|rror"
if [ "${SKIP_STAGES3:-0}" != 1 ]; then
  echo "=== three-stage build at $(($(date +%s) - t0)) s"
  MEGAKERNEL_ATTN_MAX_STAGES=3 timeout ${TESTS3_TIMEOUT:-90} python3 -m pytest -q -x -m gpu -p no:cacheprovider \
    tests/kernel/test_gpu.py -k "long_splits" 2>&1 | tee "$OUT/tests_stages3.log" | tail -2
  MEGAKERNEL_ATTN_MAX_STAGES=3 timeout ${VARIANTS_TIMEOUT:-100} python3 benchmarks/megakernel_variants.py \
    --points "$POINTS" --variants "default attn_stages=3" --steps 40 --json "$OUT/variants_stages3_build.json" 2>&1 \
    | grep -E "^b|rror"
fi
echo "=== trace b1 8K at $(($(date +%s) - t0)) s"
MEGAKERNEL_MK_TUNING=${TRACE_TUNING:-} timeout ${TRACE_TIMEOUT:-90} python3 -m megakernel bench --random-north \
  --backend megakernel --batch-size 1 --context 8192 --steps 20 --trace "$OUT/tl_b1.npz" 2>&1 \
  | grep -E "critical|SM time|phases of ATTN|a layer|normal build|rror"
rm -f "$OUT/tl_b1.npz"
echo "=== done at $(($(date +%s) - t0)) s"
bash scripts/pack_out.sh "$OUT"
