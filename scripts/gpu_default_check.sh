#!/usr/bin/env bash
# One device call (~5 min): the defaults' correctness, a short A/B, and optionally the decode sweep and a timeline,
# for a change of defaults:
#   0. MICRO="smem_align sm_stream": first (short, and a later step past the call's limit must not lose them), each
#      benchmarks/NAME.cu built and run (60 s at most), into $OUT/NAME.txt; ATTN_STREAM=1 adds attn_stream
#      (attention's copies alone, with the split's math, barrier-free).
#   1. the megakernel's GPU tests (tests/kernel -m gpu; TESTS=0 skips them);
#   2. compute-sanitizer memcheck on one tiny step of $MEMCHECK_B rows (default 6; MEMCHECK_B="" skips it) and
#      racecheck at each of $SAN_BS rows (default "6 3 2": the 4..8-, 3- and 2-row paged plans; SAN_BS="" skips);
#   3. the step at $POINTS under $VARIANTS (VARIANTS="" skips), one process;
#   4. SWEEP=1: the decode sweep of the megakernel and the graph backend (scripts/gpu_decode_sweep.sh, in $OUT/sweep);
#   5. TRACE_POINT="BxCTX ...": the profiling build's timeline at each point (summary lines; TRACE_DEFINES: its
#      switches, e.g. MK_PG_PAGE_STATS=1,MK_ATTN_STATS=1; benchmarks/page_stats.py, attn_stats.py,
#      layer_bandwidth.py and sm_states.py JSON beside it; TRACE_KEEP=1 keeps the .npz);
#   6. BUILD_AB="MK_X=0 default": the step at $AB_POINTS (default 1x8192,8x8192,16x8192) under each build in its own
#      process (comma-separated KEY=VAL switch lists as MEGAKERNEL_KERNEL_DEFINES takes them, or "default"), the
#      plan variants $AB_VARIANTS in each (default "default default": two runs; not step 3's $VARIANTS). On a card
#      with a build row (tuning.CARD_SWITCHES: the H200) every build starts from that row, "default" included;
#      MEGAKERNEL_CARD_SWITCHES=0 in the call's environment gives the plain builds;
#   7. CARD_TUNE=1: benchmarks/card_tune.py's coordinate search over the card-dependent knobs (~2-3 min; its row for
#      kernel/tuning.py CARD_TUNING in the log, every figure in $OUT/card_tune.json; CARD_TUNE_SEARCH: a subset);
# Logs and JSON under $OUT (bundle.tgz when more than 8 files).
#   run(command="MEGAKERNEL_COMMIT=<SHA> SWEEP=1 TRACE_POINT=8x8192 bash scripts/gpu_default_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
t0=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  echo "commit ${MEGAKERNEL_COMMIT:-unknown}"; } | tee "$OUT/env.txt"
MICRO=${MICRO:-}
[ "${ATTN_STREAM:-0}" = 1 ] && MICRO="$MICRO attn_stream"
for name in $MICRO; do
  echo "=== $name at $(($(date +%s) - t0)) s"
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/$name.cu -o /tmp/$name \
    && timeout 60 /tmp/$name > "$OUT/$name.txt" 2>&1; echo "rc=$?"; tail -40 "$OUT/$name.txt"
done
if [ "${TESTS:-1}" != 0 ]; then
  echo "=== tests"
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/kernel 2>&1 \
    | tee "$OUT/tests.log" | tail -3
fi
san() {  # tool, rows
  echo "=== $1, $2 rows, at $(($(date +%s) - t0)) s"
  script=$([ $1 = memcheck ] && echo "benchmarks/mk_debug.py north_like $2" || echo "benchmarks/mk_racecheck.py $2")
  MEGAKERNEL_WATCHDOG_S=300 timeout ${SAN_TIMEOUT:-120} compute-sanitizer --tool $1 --kernel-name kns=mk_decode \
    --print-limit 20 python3 $script > "$OUT/${1}_b$2.log" 2>&1
  echo "rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Race reported|cos|max rel" "$OUT/${1}_b$2.log" | tail -5
}
for b in ${MEMCHECK_B-6}; do san memcheck $b; done
for b in ${SAN_BS-6 3 2}; do san racecheck $b; done
VARIANTS=${VARIANTS-"default moe_pages=0 default moe_pages=0"}
if [ -n "$VARIANTS" ]; then
  echo "=== variants at $(($(date +%s) - t0)) s"
  timeout ${VARIANTS_TIMEOUT:-120} python3 benchmarks/megakernel_variants.py --points "${POINTS:-6x8192,8x8192,3x8192}" \
    --variants "$VARIANTS" --steps 40 --json "$OUT/variants.json" 2>&1 | grep -E "^b|rror"
fi
if [ "${SWEEP:-0}" = 1 ]; then
  echo "=== sweep at $(($(date +%s) - t0)) s"
  OUT=$OUT/sweep BACKENDS=megakernel,graph SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-240} bash scripts/gpu_decode_sweep.sh 2>&1 \
    | grep -E "megakernel \(|/ graph|rror"
fi
for point in ${TRACE_POINT:-}; do          # (one or several BxCTX, space-separated)
  bsz=${point%x*}; ctx=${point#*x}
  echo "=== trace b$bsz $ctx ${TRACE_DEFINES:-default build} at $(($(date +%s) - t0)) s"
  MEGAKERNEL_KERNEL_DEFINES=${TRACE_DEFINES:-} timeout ${TRACE_TIMEOUT:-100} python3 -m megakernel bench --random-north \
    --backend megakernel --batch-size $bsz --context $ctx --steps 20 --trace "$OUT/tl_b$bsz.npz" 2>&1 \
    | grep -E "critical|SM time|phases|a layer|MoE workers|normal build|rror"
  bash scripts/trace_reports.sh "$OUT/tl_b$bsz.npz" "$OUT/tl_b$bsz"   # (page stats, bandwidth, SM states, attention)
  [ "${TRACE_KEEP:-0}" = 1 ] || rm -f "$OUT/tl_b$bsz.npz"
done
if [ -n "${BUILD_AB:-}" ]; then             # (gpu_build_ab.sh's stage 2 alone, into $OUT/ab)
  echo "=== builds $BUILD_AB at $(($(date +%s) - t0)) s"
  OUT=$OUT/ab BUILDS="$BUILD_AB" POINTS="${AB_POINTS:-1x8192,8x8192,16x8192}" SKIP_TESTS=1 SKIP_TRACE=1 \
    VARIANTS="${AB_VARIANTS:-default default}" \
    VARIANTS_TIMEOUT=${AB_TIMEOUT:-110} bash scripts/gpu_build_ab.sh 2>&1 | grep -E "^\\[|rror"
fi
if [ "${CARD_TUNE:-0}" = 1 ]; then
  echo "=== card_tune at $(($(date +%s) - t0)) s"
  timeout ${CARD_TUNE_TIMEOUT:-300} python3 benchmarks/card_tune.py --search "${CARD_TUNE_SEARCH:-}" \
    --json "$OUT/card_tune.json" 2>&1 | grep -E "incumbent|CARD_TUNING|rror"
fi
echo "=== done at $(($(date +%s) - t0)) s"
bash scripts/pack_out.sh "$OUT"
