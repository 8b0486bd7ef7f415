#!/usr/bin/env bash
# One device call (~6 min) to decide whether the paged MoE worker becomes the default (moe_pages=8):
#   1. compute-sanitizer racecheck and memcheck on one tiny step under $PAGED (default moe_pages=8) at 6 rows, and
#      racecheck under moe_pages=1,moe_pages_from=1 at 1 row;
#   2. the tiny parity, long-split, North per-layer and watchdog GPU tests with every plan paged and a wrapped ring
#      (moe_pages=16,moe_pages_from=1,moe_pages_max=6);
#   3. the step at $POINTS under $VARIANTS, one process.
# SKIP_SAN=1 skips step 1, SAN_B1=0 its one-row racecheck, SKIP_TESTS=1 step 2.
# Logs and JSON under $OUT (bundle.tgz when more than 8 files).
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_pages_check.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
PAGED=${PAGED:-moe_pages=8}
POINTS=${POINTS:-8x8192,6x8192,1x8192,2x8192,4x8192,16x8192}
VARIANTS=${VARIANTS:-"default moe_pages=8 moe_pages=8,moe_pages_tile_kb=256 moe_pages=16,moe_pages_from=1 default moe_pages=8"}
t0=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  echo "commit ${MEGAKERNEL_COMMIT:-unknown}"; } | tee "$OUT/env.txt"
san() {  # tool, tuning, script args, log name
  echo "=== $1 under $2: $3, at $(($(date +%s) - t0)) s"
  MEGAKERNEL_MK_TUNING=$2 MEGAKERNEL_WATCHDOG_S=300 timeout ${SAN_TIMEOUT:-120} compute-sanitizer --tool $1 \
    --kernel-name kns=mk_decode --print-limit 20 python3 $3 > "$OUT/$4.log" 2>&1
  echo "rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cos vs|max rel" "$OUT/$4.log" | tail -3
  grep "Race reported" "$OUT/$4.log" | sed 's/0x[0-9a-f]*//g; s/(const[^)]*)//g' | sort | uniq -c | head -8
}
if [ "${SKIP_SAN:-0}" != 1 ]; then
  san racecheck "$PAGED" "benchmarks/mk_racecheck.py 6" racecheck_b6_paged
  san memcheck "$PAGED" "benchmarks/mk_debug.py north_like 6" memcheck_b6_paged
  [ "${SAN_B1:-1}" = 1 ] && san racecheck moe_pages=1,moe_pages_from=1 "benchmarks/mk_racecheck.py 1" racecheck_b1_paged
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "=== tests, every plan paged, at $(($(date +%s) - t0)) s"
  MEGAKERNEL_MK_TUNING=moe_pages=16,moe_pages_from=1,moe_pages_max=6 timeout ${TESTS_TIMEOUT:-120} python3 -m pytest \
    -q -x -m gpu -p no:cacheprovider tests/kernel/test_gpu.py tests/kernel/test_gpu_north.py \
    -k "tiny or long_splits or north or watchdog" 2>&1 | tee "$OUT/tests_paged.log" | tail -3
fi
echo "=== variants at $(($(date +%s) - t0)) s"
timeout ${VARIANTS_TIMEOUT:-200} python3 benchmarks/megakernel_variants.py --points "$POINTS" \
  --variants "$(echo $VARIANTS)" --steps 40 --json "$OUT/variants_paged.json" 2>&1 | grep -E "^b|rror"
echo "=== done at $(($(date +%s) - t0)) s"
bash scripts/pack_out.sh "$OUT"
