#!/usr/bin/env bash
# One device call (~6 min) for why MK_MOE_EARLY_ISSUE=1 was slower (benchmarks/SPEED_NOTES.md, seventh session,
# next step 1): the default build, the switch's modes 1 and 2 and MK_SIGNAL_FENCE=0 with and without mode 1, timed
# at batch 1 and 8 (8K); mode 2's GPU tests (mode 1's passed at 90b2c12); the SM timelines of mode 1 at batch 1 and 8
# (summaries; compare their MOE_GATE_UP "end" phase, the epilogue and signal, with tl_b{1,8}_01168ec's).
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_early_issue_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
controls="default+default MK_MOE_EARLY_ISSUE=1+default MK_SIGNAL_FENCE=0+default MK_MOE_EARLY_ISSUE=1,MK_SIGNAL_FENCE=0+default"
OUT=$OUT BUILDS="MK_MOE_EARLY_ISSUE=2+default $controls" NOTEST="$controls" POINTS=${POINTS:-1x8192,8x8192} \
  TRACE=1 TRACE_DEFINES=MK_MOE_EARLY_ISSUE=1 TRACE_BATCHES="1 8" TRACE_TIMEOUT=150 TESTS_TIMEOUT=140 \
  VARIANTS_TIMEOUT=80 timeout 570 bash scripts/gpu_switch_check.sh
