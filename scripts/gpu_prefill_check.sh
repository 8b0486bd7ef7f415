#!/usr/bin/env bash
# One device call: a profiled megakernel decode step (SM timeline, issue 10), the GPU tests of the fast prefill
# (issue 12: against the exact path, and bf16 parity with transformers), then `megakernel bench --prefill`.
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
timeout 200 python3 -m megakernel bench --random-north --backends megakernel --batch-size 1 --context 8192 \
  --steps 32 --trace "$OUT/mk_trace_b1_8k.json.gz" --json "$OUT/mk_trace_bench.json" --log-level warning 2>&1 \
  | tee "$OUT/mk_trace.log" | grep -vE "^$|Warning|warn_once"
timeout 150 python3 -m pytest -q -s -rA -m "gpu or not gpu" tests/graph/test_prefill.py tests/engine/test_gpu_engine.py \
  2>&1 | tee "$OUT/prefill_tests.log" | grep -E "worst|rel-L2|passed|failed|Error|assert" | tail -20
timeout 330 python3 -m megakernel bench --prefill --json "$OUT/prefill.json" --log-level warning 2>&1 \
  | tee "$OUT/prefill.log" | grep -vE "^$|Warning|warn_once"
