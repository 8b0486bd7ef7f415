#!/usr/bin/env bash
# Profiling-build timelines of several builds and plan variants in one device call, each into its own summary:
#   TRACES="NAME:DEFINES:TUNING:BxCTX ..." bash scripts/gpu_traces.sh
# NAME names $OUT/tl_NAME.summary.json (and the page-stats / bandwidth JSON beside it); DEFINES is a comma-separated
# switch list as MEGAKERNEL_KERNEL_DEFINES takes it, TUNING a plan-knob list as MEGAKERNEL_MK_TUNING takes it (either
# may be empty), BxCTX the point (default 1x8192). Example:
#   TRACES="base::: serial4:MK_FUSED_SERIAL=4:: pf33::l2_prefetch=33: pages:MK_PG_PAGE_STATS=1::" bash scripts/gpu_traces.sh
# Each trace prints its summary lines for the routing chain and the MoE phase (about 30-40 s a trace, the profiling
# build's compile included). TRACE_KEEP=1 keeps the .npz files (large: $OUT returns ~8 files at most).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=${MEGAKERNEL_CACHE_DIR:-/tmp/mkcache}
t0=$(date +%s)
for spec in ${TRACES:-}; do
  IFS=: read -r name defines tuning point <<< "$spec"
  point=${point:-1x8192}; bsz=${point%x*}; ctx=${point#*x}
  rm -f "/tmp/tl_$name".*              # (a failed trace must not return an earlier call's files of the same name)
  echo "=== trace $name (b$bsz $ctx, defines '${defines}', tuning '${tuning}') at $(($(date +%s) - t0)) s"
  MEGAKERNEL_KERNEL_DEFINES=$defines MEGAKERNEL_MK_TUNING=$tuning timeout ${TRACE_TIMEOUT:-100} python3 -m megakernel \
    bench --random-north --backend megakernel --batch-size "$bsz" --context "$ctx" --steps 20 \
    --trace "/tmp/tl_$name.npz" 2>&1 | grep -E "ROUTER|QKV|TOPK|OPROJ|MOE_WORKER|a layer|normal build|rror" | cut -c1-320
  cp "/tmp/tl_$name.summary.json" "$OUT/" 2>/dev/null
  # (page stats only from a build that has them: elsewhere their table is meaningless)
  case ",$defines," in *,MK_PG_PAGE_STATS=1,*) stats=print;; *) stats=skip;; esac
  PAGE_STATS=$stats bash scripts/trace_reports.sh "/tmp/tl_$name.npz" "$OUT/tl_$name"
  [ "${TRACE_KEEP:-0}" = 1 ] && cp "/tmp/tl_$name.npz" "$OUT/"
done
echo "traces done at $(($(date +%s) - t0)) s"
