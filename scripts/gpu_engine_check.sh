#!/usr/bin/env bash
# GPU checks of the engine's PyTorch path, in one device call. Output under $OUT (or ./gpu-out).
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ git rev-parse HEAD 2>/dev/null; date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c 'import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__)'; } | tee "$OUT/env.txt"
python3 -m pytest -q -s -rA -m gpu tests/engine/test_gpu_engine.py 2>&1 | tee "$OUT/engine_gpu.log"
