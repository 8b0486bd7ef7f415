#!/usr/bin/env bash
# Nsight Compute on the device (Firecracker machines read the hardware counters; clocks left alone): the GEMV
# streaming microbenchmark's compute-only mode at one shape, and (MK=1) one megakernel decode step at batch 1, 8K,
# each with warp-state statistics and per-instruction stall samples, exported as text under $OUT.
#   run(command="bash scripts/gpu_ncu.sh", timeout_s=600)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
echo "ncu: $NCU"; "$NCU" --version | tail -1
SECTIONS="--section SpeedOfLight --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis_Tables --section InstructionStats --section SchedulerStats"
report() {  # $1: report name
  "$NCU" -i "$OUT/$1.ncu-rep" --page details > "$OUT/$1_details.txt" 2>&1
  "$NCU" -i "$OUT/$1.ncu-rep" --page source --csv --print-source sass > "$OUT/$1_sass.csv" 2>&1
  gzip -f "$OUT/$1_sass.csv"; rm -f "$OUT/$1.ncu-rep"
  grep -E "Duration|Shared|Issue Slots|Warp Cycles Per Issued|Stall|Bank|Eligible|Active Warps" "$OUT/$1_details.txt" | head -40
}
for shape in ${SHAPES:-32x2048}; do
  timeout 200 "$NCU" --clock-control none --kernel-name gemv_stream --launch-skip 1 --launch-count 1 $SECTIONS \
    -o "$OUT/gs_$shape" -f python3 benchmarks/gemv_stream.py --shapes "$shape" --rows ${ROWS:-1} --modes compute \
    > "$OUT/gs_${shape}_run.log" 2>&1; echo "gemv_stream $shape rc $?"
  report "gs_$shape"
done
if [ "${MK:-0}" = 1 ]; then
  timeout 300 "$NCU" --clock-control none --graph-profiling node --kernel-name regex:mk_decode --launch-skip ${MK_SKIP:-20} --launch-count 1 \
    $SECTIONS -o "$OUT/mk_b1" -f python3 -m megakernel bench --random-north --backend megakernel --batch-size 1 \
    --context 8192 --steps 8 > "$OUT/mk_run.log" 2>&1; echo "megakernel rc $?"; tail -3 "$OUT/mk_run.log"
  report mk_b1
fi
bash scripts/pack_out.sh "$OUT"
