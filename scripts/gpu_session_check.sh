#!/usr/bin/env bash
# One device call: every gpu-marked test, then the engine at North dims (random weights): device idle time between
# decode steps with pipelined vs synchronous steps, and the decode benchmark (megakernel vs PyTorch path, batch 1,
# context 8K). Logs in $OUT.
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python3 -c 'import torch, sys; print(sys.version.split()[0], torch.__version__)'; } | tee "$OUT/env.txt"
python3 -m pytest -q -s -rA -m gpu tests/engine/test_gpu_engine.py tests/kernel/test_gpu.py tests/kernel/test_gpu_north.py \
  2>&1 | tee "$OUT/gpu_tests.log" | grep -E "identical|passed|failed|Error|assert" | tail -40
for shape in "1 8192" "8 1024"; do
  set -- $shape
  python3 benchmarks/overlap_check.py --batch-size $1 --context $2 --steps 64 --json "$OUT/overlap_b$1.json" 2>&1 \
    | tee "$OUT/overlap_b$1.log" | grep -E "^\{|Error"
done
for run in "megakernel 32" "megakernel 32 --sync-steps" "torch 6"; do
  set -- $run
  python3 -m megakernel bench --random-north --batch-size 1 --context 8192 --steps $2 --backend $1 $3 \
    --log-level warning 2>&1 | tee "$OUT/bench_$1$3.log" | grep -vE "Loading|^$"
done
