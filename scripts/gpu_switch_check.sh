#!/usr/bin/env bash
# One device call that validates and times the megakernel's compile-time switches: for every build in $BUILDS
# (space-separated; each is a MEGAKERNEL_KERNEL_DEFINES value, "default" for none, optionally followed by "+" and
# ";"-separated MEGAKERNEL_MK_TUNING values), the megakernel's GPU tests (tests/kernel, under the last tuning) and
# then the variants sweep at $POINTS (those tunings, or $DEFAULT_VARIANTS for a build without any); the SM clock
# and power sampled all along (clocks.csv); then, if TRACE=1, the SM timelines at 8K of the build $TRACE_DEFINES
# (batch sizes $TRACE_BATCHES, default 1; their summaries kept, the traces only with TRACE_KEEP=1); and, if STREAM=1,
# the GEMV streaming microbenchmark. Logs and JSON per build under $OUT. Builds named in $NOTEST (controls) skip
# their tests; $STREAM_DEFINES (space-separated, "default" for none) are the microbenchmark's builds, $STREAM_ARGS
# its arguments.
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_switch_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
BUILDS=${BUILDS:-"default MK_MOE_LOCAL=1"}
POINTS=${POINTS:-1x8192,8x8192}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  echo "commit ${MEGAKERNEL_COMMIT:-unknown}"; } | tee "$OUT/env.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 200 > "$OUT/clocks.csv" 2>&1 &
smi=$!
t0=$(date +%s)
for b in $BUILDS; do
  defines=${b%%+*}; tunings=""; [ "$b" != "$defines" ] && tunings=${b#*+}
  [ "$defines" = default ] && defines=""
  last=${tunings##*;}; [ "$last" = default ] && last=""
  tag=$(echo "${b}" | tr ',=+;' '____')
  echo "=== build '$defines' tunings '$tunings' at $(($(date +%s) - t0)) s"
  case " ${NOTEST:-} " in
    *" $b "*) echo "(tests skipped: a control build)" ;;
    *) MEGAKERNEL_KERNEL_DEFINES=$defines MEGAKERNEL_MK_TUNING=$last timeout ${TESTS_TIMEOUT:-150} \
         python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/kernel 2>&1 | tee "$OUT/tests_$tag.log" | tail -3 ;;
  esac
  MEGAKERNEL_KERNEL_DEFINES=$defines timeout ${VARIANTS_TIMEOUT:-90} python3 benchmarks/megakernel_variants.py \
    --points "$POINTS" --variants "$(echo "${tunings:-${DEFAULT_VARIANTS:-default}}" | tr ';' ' ')" --steps 30 \
    --json "$OUT/variants_$tag.json" 2>&1 | grep -E "^b|rror"
done
if [ "${TRACE:-0}" = 1 ]; then
  for tb in ${TRACE_BATCHES:-1}; do
    echo "=== trace b$tb at $(($(date +%s) - t0)) s"
    tag=tl_b$tb${TRACE_TAG:-}; ext=npz; [ "${TRACE_KEEP:-0}" = 1 ] && ext=json.gz   # .npz: summary and records only
    MEGAKERNEL_KERNEL_DEFINES=${TRACE_DEFINES:-} timeout ${TRACE_TIMEOUT:-150} python3 -m megakernel bench --random-north \
      --backend megakernel --batch-size $tb --context 8192 --steps 20 --trace "$OUT/$tag.$ext" 2>&1 \
      | grep -E "critical|SM time|phases|a layer|normal build|^megakernel|rror"
    [ "${TRACE_KEEP:-0}" = 1 ] || rm -f "$OUT/$tag.npz"
  done
fi
if [ "${STREAM:-0}" = 1 ]; then
  for sd in ${STREAM_DEFINES:-default}; do
    echo "=== gemv_stream '$sd' at $(($(date +%s) - t0)) s"
    [ "$sd" = default ] && sd=""
    MEGAKERNEL_KERNEL_DEFINES=$sd timeout ${STREAM_TIMEOUT:-90} python3 benchmarks/gemv_stream.py ${STREAM_ARGS:-} \
      --json "$OUT/gemv_stream_$(echo "${sd:-default}" | tr ',=' '__').json" 2>&1 | tail -${STREAM_TAIL:-40}
  done
fi
kill $smi 2>/dev/null
echo "=== done at $(($(date +%s) - t0)) s"
bash scripts/pack_out.sh "$OUT"
