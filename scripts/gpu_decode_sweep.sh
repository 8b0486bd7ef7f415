#!/usr/bin/env bash
# One device call: the decode sweep of `megakernel bench --sweep` (batch 1 at 1K..256K, batch 1..16 at 8K) for the
# megakernel, the CUDA-graph backend and the PyTorch path in one run, at North Mini Code dims with random weights
# and synthetic KV. JSON, PNG and log in $OUT.
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python3 -c 'import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)';
  } | tee "$OUT/env.txt"
timeout ${SWEEP_TIMEOUT:-560} python3 -m megakernel bench --random-north --backends ${BACKENDS:-megakernel,graph,torch} \
  --sweep --steps ${STEPS:-32} --torch-steps ${TORCH_STEPS:-3} --json "$OUT/decode_sweep.json" \
  --plot "$OUT/decode_sweep.png" --log-level info 2>&1 | tee "$OUT/decode_sweep.log" | grep -vE "^$|Warning|warn_once"
