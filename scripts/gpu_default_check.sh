#!/usr/bin/env bash
# One device call (~5 min): the defaults' correctness and a short A/B, for a change of defaults:
#   1. the megakernel's GPU tests (tests/kernel -m gpu);
#   2. compute-sanitizer memcheck and racecheck on one tiny step of $SAN_B rows (default 6: the 5..8-row plan);
#   3. the step at $POINTS under $VARIANTS (default: the defaults against moe_pages=8), one process.
# Logs and JSON under $OUT (bundle.tgz when more than 8 files).
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_default_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
SAN_B=${SAN_B:-6}
t0=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  echo "commit ${MEGAKERNEL_COMMIT:-unknown}"; } | tee "$OUT/env.txt"
echo "=== tests"
timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/kernel 2>&1 \
  | tee "$OUT/tests.log" | tail -3
for tool in memcheck racecheck; do
  echo "=== $tool, $SAN_B rows, at $(($(date +%s) - t0)) s"
  script=$([ $tool = memcheck ] && echo "benchmarks/mk_debug.py north_like $SAN_B" || echo "benchmarks/mk_racecheck.py $SAN_B")
  MEGAKERNEL_WATCHDOG_S=300 timeout ${SAN_TIMEOUT:-120} compute-sanitizer --tool $tool --kernel-name kns=mk_decode \
    --print-limit 20 python3 $script > "$OUT/$tool.log" 2>&1
  echo "rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error|hazard|cos|max" "$OUT/$tool.log" | tail -5
done
echo "=== variants at $(($(date +%s) - t0)) s"
timeout ${VARIANTS_TIMEOUT:-120} python3 benchmarks/megakernel_variants.py --points "${POINTS:-6x8192,8x8192,5x8192}" \
  --variants "${VARIANTS:-default moe_pages=8 default moe_pages=8}" --steps 40 --json "$OUT/variants.json" 2>&1 \
  | grep -E "^b|rror"
echo "=== done at $(($(date +%s) - t0)) s"
bash scripts/pack_out.sh "$OUT"
