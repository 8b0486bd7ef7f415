#!/usr/bin/env bash
# One device call for the megakernel's SM timeline (issue 10): the megakernel's gpu tests (parity, watchdog, the
# profiling build's invariants), then one profiled decode step at North dims (batch 1, 8K, random weights): Chrome
# trace, PNG, summary, and the profiling build timed against the normal one in the same run. Output in $OUT.
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q -s -rA -m gpu tests/kernel/test_gpu_profile.py tests/kernel/test_gpu.py 2>&1 \
  | tee "$OUT/mk_tests.log" | grep -E "tasks,|identical|passed|failed|Error|assert" | tail -30
timeout 240 python3 -m megakernel bench --random-north --backends megakernel --batch-size 1 --context 8192 \
  --steps 32 --trace "$OUT/mk_trace_b1_8k.json.gz" --json "$OUT/mk_trace_bench.json" --log-level warning 2>&1 \
  | tee "$OUT/mk_trace.log" | grep -vE "^$|Warning|warn_once"
