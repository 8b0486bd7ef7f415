#!/usr/bin/env bash
# One device call (~7 min, each stage's timeout keeps the whole under 600 s) for why MK_MOE_EARLY_ISSUE=1 was
# slower (benchmarks/SPEED_NOTES.md, seventh session, next step 1):
#   1. the GEMV microbenchmark's gate/up item tail on 132 and 32 SMs (modes epi*: does the signal's fence or
#      release wait for a tile copy in flight?);
#   2. the default build, the switch's modes 1 and 2, and mode 1 with MK_SIGNAL_FENCE=0, timed at batch 1 and 8
#      (8K); mode 2's GPU tests (mode 1's passed at 90b2c12, before its decode moved to the issuing warp);
#   3. the SM timeline of mode 1 at batch 8 (summary: compare the MOE_GATE_UP "end" phase, the epilogue and
#      signal, with tl_b8_01168ec's).
# Everything comes back in $OUT/bundle.tgz.
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_early_issue_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
echo "=== gemv_stream: the gate/up item's tail"                 # first: the cheapest, most direct answer
for g in 132 32; do                      # every SM (the HBM ceiling), and 32 (what an SM does between its loads)
  timeout 45 python3 benchmarks/gemv_stream.py --shapes 32x2048,64x768 --rows 1,8 --grid $g \
    --modes serial,epi,epi_nf,epi_early,epi_early_nf --json "$OUT/gemv_stream_epi_g$g.json" 2>&1 | tail -21
done
controls="default+default MK_MOE_EARLY_ISSUE=1+default MK_MOE_EARLY_ISSUE=1,MK_SIGNAL_FENCE=0+default"
OUT=$OUT BUILDS="MK_MOE_EARLY_ISSUE=2+default $controls" NOTEST="$controls" POINTS=${POINTS:-1x8192,8x8192} \
  TRACE=1 TRACE_DEFINES=MK_MOE_EARLY_ISSUE=1 TRACE_BATCHES=8 TRACE_TIMEOUT=120 TESTS_TIMEOUT=160 \
  VARIANTS_TIMEOUT=80 timeout 400 bash scripts/gpu_switch_check.sh
