#!/usr/bin/env bash
# One device call: megakernel GPU tests (tiny parity, watchdog, LLM.generate vs torch on north_nano) and the
# engine-level decode benchmark at North dims (megakernel vs PyTorch path, batch 1, context 8K). Logs in $OUT.
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python3 -c 'import torch, sys; print(sys.version.split()[0], torch.__version__)'; } | tee "$OUT/env.txt"
python3 -m pytest -q -s -rA -m gpu tests/kernel/test_gpu.py -k "llm_generate or available or watchdog" 2>&1 \
  | tee "$OUT/kernel_gpu.log" | grep -E "identical|passed|failed|Error|assert" | head -40
for b in megakernel torch; do
  steps=32; [ $b = torch ] && steps=6
  python3 -m megakernel bench --random-north --batch-size 1 --context 8192 --steps $steps --backend $b \
    --log-level warning 2>&1 | tee "$OUT/bench_$b.log" | grep -vE "Loading|^$"
done
