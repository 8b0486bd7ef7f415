#!/usr/bin/env bash
# One device call (~7 min; each stage's timeout keeps the whole under 600 s) for the ninth session's plan knobs
# (benchmarks/SPEED_NOTES.md): topk_warp (TOPK's queue in one warp), router_topk (the last router tile routes),
# wide_split_batch (1024-key attention splits from 4 rows). Its first run (d00cb4d) also timed wchunks, poll_ahead and
# o_prefetch, since removed (SPEED_NOTES.md says why). Stages:
#   1. the megakernel's GPU tests (tests/kernel) under the defaults, then the tiny parity, the long attention splits
#      and the per-layer North acceptance under $ALSO_TUNING (default router_topk=1);
#   2. the step at $POINTS under $VARIANTS, one process (each knob's A/B in the same process);
#   3. the SM timeline at batch 1, 8K, of the defaults (summary only).
# Everything comes back in $OUT/bundle.tgz. DEFAULT_TESTS=0 skips stage 1's default run; ALSO_TUNING_2: a second
# tuning for stage 1's tiny / long-split / North tests; LONG_POINTS with LONG_VARIANTS: a second variants run (e.g.
# long contexts under other knobs) after the first; TRACE_TUNING: the plan overrides the timeline runs under
# (MEGAKERNEL_MK_TUNING's syntax).
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_ninth_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
POINTS=${POINTS:-1x8192,2x8192,8x8192,1x32768}
VARIANTS=${VARIANTS:-"default topk_warp=0 router_topk=1 wide_split_batch=0 wide_split_batch=2 default"}
ALSO_TUNING=${ALSO_TUNING:-router_topk=1}
t0=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  echo "commit ${MEGAKERNEL_COMMIT:-unknown}"; } | tee "$OUT/env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  if [ "${DEFAULT_TESTS:-1}" = 1 ]; then
    echo "=== tests, defaults"
    timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/kernel 2>&1 \
      | tee "$OUT/tests_default.log" | tail -3
  fi
  n=1                                   # (logs: tests_also.log, then tests_also2.log)
  for tuning in "$ALSO_TUNING" ${ALSO_TUNING_2:+"$ALSO_TUNING_2"}; do
    echo "=== tests under $tuning at $(($(date +%s) - t0)) s"
    MEGAKERNEL_MK_TUNING=$tuning timeout ${ALSO_TIMEOUT:-110} python3 -m pytest -q -x -m gpu -p no:cacheprovider \
      tests/kernel/test_gpu.py tests/kernel/test_gpu_north.py -k "tiny or long_splits or north or watchdog" 2>&1 \
      | tee "$OUT/tests_also$([ $n = 1 ] || echo $n).log" | tail -3
    n=$((n + 1))
  done
fi
echo "=== variants at $(($(date +%s) - t0)) s"
timeout ${VARIANTS_TIMEOUT:-200} python3 benchmarks/megakernel_variants.py --points "$POINTS" \
  --variants "$(echo $VARIANTS)" --steps 40 --json "$OUT/variants.json" 2>&1 | grep -E "^b|rror"
if [ -n "${LONG_POINTS:-}" ]; then
  echo "=== variants at $LONG_POINTS at $(($(date +%s) - t0)) s"
  timeout ${LONG_TIMEOUT:-120} python3 benchmarks/megakernel_variants.py --points "$LONG_POINTS" \
    --variants "$(echo ${LONG_VARIANTS:-default})" --steps 40 --json "$OUT/variants_long.json" 2>&1 | grep -E "^b|rror"
fi
echo "=== trace b1 at $(($(date +%s) - t0)) s"
MEGAKERNEL_MK_TUNING=${TRACE_TUNING:-} timeout ${TRACE_TIMEOUT:-90} python3 -m megakernel bench --random-north --backend megakernel --batch-size 1 \
  --context 8192 --steps 20 --trace "$OUT/tl_b1.npz" 2>&1 | grep -E "critical|SM time|phases|a layer|MoE workers|normal build|rror"
rm -f "$OUT/tl_b1.npz"
echo "=== done at $(($(date +%s) - t0)) s"
bash scripts/pack_out.sh "$OUT"
