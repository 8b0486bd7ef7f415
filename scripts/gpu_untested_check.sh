#!/usr/bin/env bash
# One device call (~7-8 min) for what landed without a GPU in the sixth session (benchmarks/SPEED_NOTES.md), its three
# checks in one machine start (each call saved is ~1 min of start-up, from 30 device-minutes a session):
#   1. knobs/   the default build's GPU tests under the default knobs (the default code changed: TOPK through
#               topk_route, the knobs' branches), MK_SMALL_VEC=3's under worker_topk=1,o_queue=1,o_after=4; both builds
#               timed over the knobs at batch 1 and 8; the SM timeline of MK_SMALL_VEC=3 at batch 1, 8K;
#   2. combine/ combine_parts 1 / 2 / 4 / 8 at batch 1, 8K / 128K / 256K (its GPU tests under combine_parts=2, which
#               the tiny test model's two query heads per kv head allow);
#   3. swz/     the GEMV microbenchmark's swizzled tiles by 2D boxes and by 3D copies (whole tile, 16-row sub-tiles).
# Each stage writes under $OUT/<stage>/, all packed into $OUT/bundle.tgz at the end. Typical run ~450 s; the stages'
# timeouts are looser. It ran on 2026-12-02 (results/2026-12-02-speed-h200-session7.md); since then `o_queue` counts
# rows (o_queue=1 here now queues the O tiles of one-row launches only; o_queue=16 is the old meaning).
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_untested_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
t0=$(date +%s)
echo "=== 1. knobs at 0 s"
OUT=$OUT/knobs BUILDS=${BUILDS_KNOBS:-"default+worker_topk=1;o_queue=1,o_after=4;worker_topk=1,o_queue=1,o_after=4;default MK_SMALL_VEC=3+default;o_queue=1,o_after=2;o_queue=1,o_after=6;o_queue=1,o_after=8;worker_topk=1,o_queue=1,o_after=4"} \
  TRACE=1 TRACE_DEFINES=MK_SMALL_VEC=3 TESTS_TIMEOUT=120 timeout 330 bash scripts/gpu_switch_check.sh
echo "=== 2. combine_parts at $(($(date +%s) - t0)) s"
OUT=$OUT/combine POINTS=1x8192,1x131072,1x262144 \
  BUILDS=${BUILDS_COMBINE:-"default+default;combine_parts=4;combine_parts=8;combine_parts=2"} TESTS_TIMEOUT=120 \
  VARIANTS_TIMEOUT=150 timeout 250 bash scripts/gpu_switch_check.sh
echo "=== 3. swizzled tiles at $(($(date +%s) - t0)) s"
OUT=$OUT/swz NCU=0 timeout 150 bash scripts/gpu_swz_check.sh
bash scripts/pack_out.sh "$OUT"
echo "=== done at $(($(date +%s) - t0)) s"
