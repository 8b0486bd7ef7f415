#!/usr/bin/env bash
# One device call (~6 min): compile-time switches A/B, each build in its own process, plus the default build's GPU
# tests and a timeline. Stages (each bounded so the whole stays under 600 s):
#   1. the megakernel's GPU tests under the default build (tests/kernel; SKIP_TESTS=1 skips);
#   (on a card with a build row, tuning.CARD_SWITCHES, every build starts from it: MEGAKERNEL_CARD_SWITCHES=0 for the
#   plain ones)
#   2. the step at $POINTS for each build in $BUILDS (space-separated; "default" or comma-separated KEY=VAL switch
#      lists as MEGAKERNEL_KERNEL_DEFINES takes them), two runs each;
#   3. a timeline at $TRACE_POINT (BxCTX, default 8x8192) under the default build (summary only; SKIP_TRACE=1 skips).
# Everything comes back in $OUT/bundle.tgz.
#   run(command="MEGAKERNEL_COMMIT=<SHA> BUILDS='MK_ATTN_BULK=2 default' bash scripts/gpu_build_ab.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
POINTS=${POINTS:-1x8192,8x8192,1x131072}
BUILDS=${BUILDS:-default}
TRACE_POINT=${TRACE_POINT:-8x8192}
t0=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  echo "commit ${MEGAKERNEL_COMMIT:-unknown}"; } | tee "$OUT/env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "=== tests, default build"
  timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -q -x -m gpu -p no:cacheprovider ${TESTS:-tests/kernel} 2>&1 \
    | tee "$OUT/tests_default.log" | tail -3
fi
declare -A runs=()
for b in $BUILDS; do
  defs=$([ "$b" = default ] && echo "" || echo "$b")
  tag=$(echo "${b}" | tr ',=' '__')
  runs[$tag]=$(( ${runs[$tag]:-0} + 1 ))   # (a build listed twice: its second run's JSON beside the first's)
  echo "=== build $b (run ${runs[$tag]}) at $POINTS, $(($(date +%s) - t0)) s"
  MEGAKERNEL_KERNEL_DEFINES=$defs timeout ${VARIANTS_TIMEOUT:-110} python3 benchmarks/megakernel_variants.py \
    --points "$POINTS" --variants "${VARIANTS:-default default}" --steps 40 \
    --json "$OUT/variants_${tag}_run${runs[$tag]}.json" 2>&1 | grep -E "^b|rror" | sed "s|^|[$b #${runs[$tag]}] |"
done
if [ "${SKIP_TRACE:-0}" != 1 ]; then
  bsz=${TRACE_POINT%x*}; ctx=${TRACE_POINT#*x}
  echo "=== trace b$bsz ${ctx}, default build, at $(($(date +%s) - t0)) s"
  timeout ${TRACE_TIMEOUT:-100} python3 -m megakernel bench --random-north --backend megakernel --batch-size $bsz \
    --context $ctx --steps 20 --trace "$OUT/tl_b$bsz.npz" 2>&1 \
    | grep -E "critical|SM time|phases|a layer|MoE workers|normal build|rror"
  rm -f "$OUT/tl_b$bsz.npz"
fi
echo "=== done at $(($(date +%s) - t0)) s"
bash scripts/pack_out.sh "$OUT"
