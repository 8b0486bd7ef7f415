#!/usr/bin/env bash
# One device call (~7 min; each stage's timeout keeps the whole under 600 s) for a GEMV core build $NEW (a
# MEGAKERNEL_KERNEL_DEFINES value; e.g. the tensor-core cores of cbb5d74, MK_GEMV_TC=3,MK_GEMV_B1=3, measured and
# removed: benchmarks/SPEED_NOTES.md, eighth session) and $ALSO (more builds, timed only):
#   1. the GEMV microbenchmark, today's cores against $NEW and $ALSO: math alone (compute), load then math (serial)
#      and double-buffered, at 1, 8 and 16 input rows, for the plan's tile shapes, $STREAM_TILES tiles per SM per
#      launch (240: the launch's own ~30-50 us spread thin);
#   2. $NEW's megakernel GPU tests (tests/kernel: tiny parity at batch 1/3/8/16, the per-layer North acceptance, ...);
#   3. the step at $POINTS: the default build (control), then $NEW under $NEW_VARIANTS (with a faster core the
#      double-buffered plans may pay: moe_ring, prefetch).
# Everything comes back in $OUT/bundle.tgz.
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_core_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
NEW=${NEW:?set NEW to the build to test, e.g. NEW=MK_GEMV_B1=0}
ALSO=${ALSO:-}
NEW_VARIANTS=${NEW_VARIANTS:-"moe_ring=16;prefetch=1;default"}
POINTS=${POINTS:-1x8192,8x8192,16x8192}
t0=$(date +%s)
if [ "${SKIP_STREAM:-0}" != 1 ]; then
  for sd in default "$NEW" $ALSO; do
    echo "=== gemv_stream '$sd' at $(($(date +%s) - t0)) s"
    d=$sd; [ "$d" = default ] && d=""
    MEGAKERNEL_KERNEL_DEFINES=$d timeout 100 python3 benchmarks/gemv_stream.py --rows ${STREAM_ROWS:-1,8,16} \
      --shapes ${STREAM_SHAPES:-32x2048,24x2048,16x4096,64x768,48x768} \
      --modes ${STREAM_MODES:-compute,serial,double} --tiles ${STREAM_TILES:-240} \
      --json "$OUT/gemv_stream_$(echo "$sd" | tr ',=' '__').json" 2>&1 | grep -E "us/tile|rror|off by|peak"
  done
fi
OUT=$OUT BUILDS="$NEW+$NEW_VARIANTS $(for a in $ALSO; do printf "%s+default " $a; done)default+default" \
  NOTEST="default+default $(for a in $ALSO; do printf "%s+default " $a; done)" POINTS=$POINTS \
  TESTS_TIMEOUT=${TESTS_TIMEOUT:-170} VARIANTS_TIMEOUT=${VARIANTS_TIMEOUT:-110} \
  timeout $((590 - ($(date +%s) - t0))) bash scripts/gpu_switch_check.sh
bash scripts/pack_out.sh "$OUT"
