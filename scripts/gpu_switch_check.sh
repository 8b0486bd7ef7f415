#!/usr/bin/env bash
# One device call that validates and times the megakernel's compile-time switches: for every build in $BUILDS
# (space-separated; each is a MEGAKERNEL_KERNEL_DEFINES value, "default" for none, optionally followed by
# "+" and a MEGAKERNEL_MK_TUNING value), the megakernel's GPU tests (tests/kernel) and then the variants sweep at
# $POINTS (that tuning, or $DEFAULT_VARIANTS for a build without one: the expert ring without the warp-specialised
# worker is the control); then the GEMV streaming microbenchmark once. Logs and JSON per build under $OUT.
#   run(command="MEGAKERNEL_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_switch_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
BUILDS=${BUILDS:-"default MK_WS_MOE=1+moe_ring=1"}
POINTS=${POINTS:-1x8192,8x8192}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  echo "commit ${MEGAKERNEL_COMMIT:-unknown}"; } | tee "$OUT/env.txt"
t0=$(date +%s)
for b in $BUILDS; do
  defines=${b%%+*}; tuning=""; [ "$b" != "$defines" ] && tuning=${b#*+}
  [ "$defines" = default ] && defines=""
  tag=$(echo "${b}" | tr ',=+' '___')
  echo "=== build '$defines' tuning '$tuning' at $(($(date +%s) - t0)) s"
  MEGAKERNEL_KERNEL_DEFINES=$defines MEGAKERNEL_MK_TUNING=$tuning timeout ${TESTS_TIMEOUT:-150} \
    python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/kernel 2>&1 | tee "$OUT/tests_$tag.log" | tail -3
  MEGAKERNEL_KERNEL_DEFINES=$defines timeout ${VARIANTS_TIMEOUT:-90} python3 benchmarks/megakernel_variants.py \
    --points "$POINTS" --variants "${tuning:-${DEFAULT_VARIANTS:-default moe_ring=1}}" --steps 30 \
    --json "$OUT/variants_$tag.json" 2>&1 \
    | grep -E "^b|rror" | tee "$OUT/variants_$tag.log"
done
echo "=== gemv_stream at $(($(date +%s) - t0)) s"
timeout ${STREAM_TIMEOUT:-90} python3 benchmarks/gemv_stream.py --json "$OUT/gemv_stream.json" 2>&1 \
  | tee "$OUT/gemv_stream.log" | tail -40
echo "=== done at $(($(date +%s) - t0)) s"
