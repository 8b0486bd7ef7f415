#!/usr/bin/env bash
# compute-sanitizer memcheck on the North per-layer run (b1, 100 keys, one step) under $TUNING (default moe_pages=1,moe_pages_from=1).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests PYTHONUNBUFFERED=1 MEGAKERNEL_CACHE_DIR=/tmp/mkcache MEGAKERNEL_WATCHDOG_S=300
export MEGAKERNEL_MK_TUNING=${TUNING:-moe_pages=1,moe_pages_from=1}
cat > /tmp/rep.py <<'PY'
import torch
from megakernel.config import north_mini_code_config
from megakernel.model.cohere2_moe import Cohere2MoeModel
from megakernel.model.weights import random_weights
from benchmarks.north_acceptance import run_shape
cfg = north_mini_code_config()
w = random_weights(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
r = run_shape(cfg, w, Cohere2MoeModel(cfg, w), 1, 100, steps=1, seed=7)
print({k: v for k, v in r.items() if not isinstance(v, (list, dict))})
PY
timeout ${TO:-300} compute-sanitizer --tool memcheck --kernel-name kns=mk_decode --print-limit 10 \
  --show-backtrace device python3 /tmp/rep.py 2>&1 | grep -v "^frame" | tail -60 | tee "$OUT/memcheck.log"
