#!/usr/bin/env bash
# Build, test and benchmark the decode megakernel on the GPU machine in one call; logs under $OUT (or ./gpu_out).
#   scripts/gpu_kernel_check.sh [stage ...]
# stages: info build debug tests sanitizer parity-quick parity bench (default: all but parity)
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export MEGAKERNEL_CACHE_DIR=${MEGAKERNEL_CACHE_DIR:-/tmp/mkcache}
export PYTHONPATH=$PWD:$PWD/tests:${PYTHONPATH:-}     # the debug tools use the tests' tiny configs
LOG=$OUT/log.txt
STAGES=${*:-info build debug tests sanitizer parity-quick bench}
PARITY=${PARITY:-1x100,16x5000}
TAME=${TAME:-1x100,3x5000,8x32768,16x5000}
STEPS=${STEPS:-256}
BUDGET=${BUDGET:-45}
t_start=$(date +%s)

stage() {  # name timeout cmd...
  local name=$1 to=$2; shift 2
  echo "=== $name ($(($(date +%s) - t_start))s) : $*" | tee -a "$LOG"
  timeout "$to" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name rc=$rc ($(($(date +%s) - t_start))s)" | tee -a "$LOG"
  tail -n 25 "$LOG" | sed 's/^/    /'
  return $rc
}

for s in $STAGES; do
  case $s in
    info) stage info 60 bash -c "nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; \
                                 python3 -c 'import torch;print(torch.__version__, torch.cuda.get_device_name())'; \
                                 nvcc --version | tail -1; git log -1 --format='%H %cd' 2>/dev/null || true" ;;
    build) stage build 300 python3 -m megakernel.kernel.build ;;
    debug) stage debug 180 python3 benchmarks/mk_debug.py north_like 3 || { [ -n "${STOP_ON_FAIL:-}" ] && break; }
           stage debug2 180 python3 benchmarks/mk_debug.py softmax_shared_avg_untied_g4 16 ;;
    tests) stage tests 420 python3 -m pytest -x -q -p no:cacheprovider tests/kernel -m gpu ;;
    sanitizer)
      MEGAKERNEL_WATCHDOG_S=300 stage memcheck 300 compute-sanitizer --tool memcheck --kernel-name kns=mk_decode \
        --print-limit 20 python3 benchmarks/mk_debug.py north_like 3
      MEGAKERNEL_WATCHDOG_S=300 stage racecheck 300 compute-sanitizer --tool racecheck --kernel-name kns=mk_decode \
        --print-limit 20 python3 benchmarks/mk_racecheck.py 3 ;;
    parity-quick) stage parity-quick 400 python3 benchmarks/north_check.py --parity 1x100,3x5000 --steps 16 \
                    --budget 60 --json "$OUT/parity_quick.json" ;;
    parity) stage parity 590 python3 benchmarks/north_check.py --parity "$PARITY" --tame-parity "$TAME" \
              --steps "$STEPS" --budget "$BUDGET" --bench --json "$OUT/parity.json" ;;
    bench) stage bench 300 python3 benchmarks/north_check.py --bench --json "$OUT/bench.json" ;;
    *) echo "unknown stage $s" ;;
  esac
done
echo "total $(($(date +%s) - t_start))s"
