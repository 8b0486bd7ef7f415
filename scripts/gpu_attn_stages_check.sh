#!/usr/bin/env bash
# One device call (~5 min) for the three-stage attention ring (MEGAKERNEL_ATTN_MAX_STAGES=3, read at import, so the
# two builds run in separate processes): 1. the default build's step at $POINTS; 2. under the three-stage build, the
# long-split ring test at 2 and 3 stages, then the step at $POINTS for attn_stages=2 and 3 in one process; 3. a b1
# timeline at $TRACE_CTX under attn_stages=3 (summary only). Everything comes back in $OUT/bundle.tgz.
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_attn_stages_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
POINTS=${POINTS:-1x8192,8x8192,1x32768,1x131072}
TRACE_CTX=${TRACE_CTX:-8192}
t0=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  echo "commit ${MEGAKERNEL_COMMIT:-unknown}"; } | tee "$OUT/env.txt"
echo "=== default build at $POINTS"
timeout ${VARIANTS_TIMEOUT:-150} python3 benchmarks/megakernel_variants.py --points "$POINTS" --variants "default" \
  --steps 40 --json "$OUT/variants_default_build.json" 2>&1 | grep -E "^b|rror"
export MEGAKERNEL_ATTN_MAX_STAGES=3
echo "=== three-stage build: ring test at $(($(date +%s) - t0)) s"
timeout ${TESTS_TIMEOUT:-120} python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/kernel/test_gpu.py \
  -k "long_splits or tiny" 2>&1 | tee "$OUT/tests_stages3.log" | tail -3
echo "=== three-stage build: variants at $(($(date +%s) - t0)) s"
timeout ${VARIANTS3_TIMEOUT:-200} python3 benchmarks/megakernel_variants.py --points "$POINTS" \
  --variants "default attn_stages=3 default attn_stages=3" --steps 40 --json "$OUT/variants_stages3_build.json" 2>&1 \
  | grep -E "^b|rror"
echo "=== trace b1 ${TRACE_CTX} attn_stages=3 at $(($(date +%s) - t0)) s"
MEGAKERNEL_MK_TUNING=attn_stages=3 timeout ${TRACE_TIMEOUT:-90} python3 -m megakernel bench --random-north \
  --backend megakernel --batch-size 1 --context "$TRACE_CTX" --steps 20 --trace "$OUT/tl_b1.npz" 2>&1 \
  | grep -E "critical|SM time|phases of ATTN|a layer|normal build|rror"
rm -f "$OUT/tl_b1.npz"
echo "=== done at $(($(date +%s) - t0)) s"
bash scripts/pack_out.sh "$OUT"
