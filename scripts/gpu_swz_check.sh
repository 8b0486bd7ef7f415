#!/usr/bin/env bash
# One device call (~2-3 min): the swizzled weight tiles of csrc/mk_gemv_swz.cuh against today's layout, in the GEMV
# microbenchmark alone. For each shape and input-row count: today's serial / double / compute modes, then the
# swizzled ones with one box per 64 columns (the tile's height), with fixed 8-row boxes, and with one 3D tensor
# copy per tile (NCU=0 skips Nsight Compute; MODES3D picks the 3D run's modes); every mode that loads
# checks both ends of each tile against torch (fp32). Then (NCU=1) Nsight Compute on the swizzled compute mode at
# 8 input rows, to confirm the bank conflicts are gone. JSON and logs under $OUT.
#   run(command="bash scripts/gpu_swz_check.sh", timeout_s=400)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SHAPES=${SHAPES:-32x2048,24x2048,16x4096,64x768,48x768}
ROWS=${ROWS:-1,8,16}
t0=$(date +%s)
timeout 150 python3 benchmarks/gemv_stream.py --shapes "$SHAPES" --rows "$ROWS" \
  --modes serial,double,compute,swz_serial,swz_double,swz_compute --json "$OUT/gemv_swz_boxR.json" 2>&1 \
  | tee "$OUT/gemv_swz_boxR.log" | grep -vE "^$"
echo "=== 8-row boxes at $(($(date +%s) - t0)) s"
timeout 100 python3 benchmarks/gemv_stream.py --shapes "$SHAPES" --rows "$ROWS" --swz-box-rows 8 \
  --modes swz_serial,swz_double,swz_compute --json "$OUT/gemv_swz_box8.json" 2>&1 | tee "$OUT/gemv_swz_box8.log" \
  | grep -vE "^$"
echo "=== one 3D tensor copy per tile at $(($(date +%s) - t0)) s"
timeout 100 python3 benchmarks/gemv_stream.py --shapes "$SHAPES" --rows "$ROWS" --swz-box-rows -1 \
  --modes "${MODES3D:-serial,swz_serial,swz_double}" --json "$OUT/gemv_swz_3d.json" 2>&1 | tee "$OUT/gemv_swz_3d.log" \
  | grep -vE "^$"
echo "=== one 3D tensor copy per 16 rows (16-row sub-tiles, the megakernel's MK_SWZ_3D) at $(($(date +%s) - t0)) s"
timeout 100 python3 benchmarks/gemv_stream.py --shapes "$SHAPES" --rows "$ROWS" --swz-box-rows -16 \
  --modes "${MODES3D:-serial,swz_serial,swz_double},swz_compute" --json "$OUT/gemv_swz_3d16.json" 2>&1 \
  | tee "$OUT/gemv_swz_3d16.log" | grep -vE "^$"
if [ "${NCU:-1}" = 1 ]; then
  echo "=== ncu at $(($(date +%s) - t0)) s"
  NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout 120 "$NCU_BIN" --clock-control none --kernel-name gemv_stream --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis_Tables --section SchedulerStats \
    -o "$OUT/ncu_swz" -f python3 benchmarks/gemv_stream.py --shapes 32x2048 --rows 8 --modes swz_compute \
    > "$OUT/ncu_swz_run.log" 2>&1
  "$NCU_BIN" -i "$OUT/ncu_swz.ncu-rep" --page details > "$OUT/ncu_swz_details.txt" 2>&1; rm -f "$OUT/ncu_swz.ncu-rep"
  grep -E "Duration|L1/TEX Cache|bank|Issued Warp" "$OUT/ncu_swz_details.txt" | head -8
fi
echo "=== done at $(($(date +%s) - t0)) s"
