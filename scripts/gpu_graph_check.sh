#!/usr/bin/env bash
# One device call for the CUDA-graph backend: its gpu tests, then the engine at North dims (random weights) with the
# graph backend and a per-kernel GPU-time profile, and the kernels' microbenchmark. Logs in $OUT.
# Stages: tests, kernels, bench (default: tests bench).
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
stages=${*:-tests bench}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python3 -c 'import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)'; } \
  | tee "$OUT/env.txt"
for stage in $stages; do
  case $stage in
    tests)
      timeout 420 python3 -m pytest -q -s -rA -m gpu tests/graph/test_graph_gpu.py 2>&1 | tee "$OUT/graph_tests.log" \
        | grep -E "identical|preemptions|passed|failed|Error|assert|first difference" | tail -40 ;;
    kernels)
      timeout 400 python3 benchmarks/graph_kernels.py --batch 1,8 --json "$OUT/kernels.json" 2>&1 \
        | tee "$OUT/kernels.log" | grep -E "BEST|Error" ;;
    bench)
      timeout 400 python3 -m megakernel bench --random-north --backends graph --batch-size 1,8 --context 8192 \
        --steps 16 ${PROFILE:+--profile-kernels} --json "$OUT/bench_graph.json" --log-level info 2>&1 \
        | tee "$OUT/bench_graph.log" | grep -vE "^$|UserWarning|_warn_once" | tail -60 ;;
    variants)     # the graph backend with PDL / our GEMV switched off, and the megakernel, same run
      for v in ${GRAPH_VARIANTS:-"streams=1" "streams=1,pdl=1" "triton_gemv=1"}; do
        MEGAKERNEL_GRAPH_TUNING=$v timeout 200 python3 -m megakernel bench --random-north --backends graph \
          --batch-size 1,8 --context 8192 --steps 16 --log-level warning 2>&1 | grep -E "^graph|Error" | sed "s/^/$v: /"
      done
      [ -n "$WITH_MEGAKERNEL" ] && timeout 200 python3 -m megakernel bench --random-north --backends megakernel \
        --batch-size 1,8 --context 8192 --steps 16 --log-level warning 2>&1 | grep -E "^megakernel|Error" ;;
  esac
done
