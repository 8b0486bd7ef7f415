#!/usr/bin/env bash
# One device call: `megakernel bench serve` on the H200, end to end through `megakernel serve --random-north` (North
# Mini Code, random weights), every workload (fixed 1K/1K, code-mix, long 32K/256) x concurrency {1, 8, 16} x decode
# backend {megakernel, graph, torch}, one server per backend. JSON, PNG, markdown table, server logs in $OUT.
#
# The device machine lacks the server's packages: carry them as wheels (`bash scripts/gpu_server_wheels.sh` fills
# the git-ignored .whl/, 6.6 MB). From the repo root here:
#   run(command="MEGAKERNEL_COMMIT=<SHA> bash scripts/gpu_bench_serve.sh",
#       carry=[".whl"], timeout_s=600)
# (write the hash out: the device tree has no .git).
#
# Device time, about 8.5 minutes: three server starts with random weights (~20 s each, the megakernel's nvcc build
# and the graph backend's Triton compile and capture included), a 2-request warm-up each, and 27 runs bounded in
# time (the request bound, 1000, never binds). Seconds per run, from the decode rates of 2026-12-01 (megakernel 144
# tok/s at batch 1, graph 320, torch 9; prefill ~1.5K tok/s on the PyTorch path for every backend, 2048-token
# chunks; with the library prefill since, the long runs' 32K prompts take ~1.3 s):
#   megakernel, graph:  fixed 8 / 18 / 8 (c=1 / 8 / 16), code-mix 8 / 22 / 8, long 25 / 25 / 25    = 147 s each
#   torch:              fixed 5 / 6 / 5, code-mix 5 / 6 / 5, long 25 / 25 / 25                     = 107 s
# plus ~1-2 s per run to abort the cut requests and see the server idle. Long runs need 25 s: one 32K prefill takes
# ~22 s, so at concurrency 8 and 16 only the first request gets its first token (the others count as cut, without
# one). Runs are cut at their limit, so a 1K-output request at concurrency 8+ never completes in the window (its
# tokens still count in output tok/s; E2E then has no samples). SCALE=2 doubles every bound (then run one backend
# per call: BACKENDS=megakernel SCALE=2 ... about 6 min); MAX_SECONDS replaces the whole bound list; CHUNK sets
# --max-num-batched-tokens (default: the server's, 8192 with fast prefill); BACKENDS, WORKLOADS, CONCURRENCY and TARGET (default --random-north) what runs. The bench
# is killed at BENCH_TIMEOUT (570 s): every finished run is already in the JSON, and the table and plot are drawn
# from it afterwards.
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python3 -c 'import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)';
  python3 -c 'import fastapi, uvicorn, pydantic, prometheus_client, llguidance, httpx; print("server packages ok")';
  echo "commit ${MEGAKERNEL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"; } | tee "$OUT/env.txt"
BOUNDS=${MAX_SECONDS:-"8,fixed@8=18,code-mix@8=22,long=25,torch=5,torch/fixed@8=6,torch/code-mix@8=6,torch/long=25"}
timeout -s TERM ${BENCH_TIMEOUT:-570} ${PYTHON:-python3} -m megakernel bench serve ${TARGET---random-north} \
  --backends ${BACKENDS:-megakernel,graph,torch} --workloads ${WORKLOADS:-fixed,code-mix,long} \
  --concurrency ${CONCURRENCY:-1,8,16} \
  --num-requests 1000 --max-seconds "$BOUNDS" --time-scale ${SCALE:-1} ${CHUNK:+--max-num-batched-tokens $CHUNK} \
  --json "$OUT/bench_serve.json" --server-log-dir "$OUT" --no-progress 2>&1 | tee "$OUT/bench_serve.log" \
  | grep -E "^megakernel.bench_serve: [a-z]+ .* c=|error|Error|Traceback"
echo "bench exit: ${PIPESTATUS[0]}"
[ -f "$OUT/bench_serve.json" ] && ${PYTHON:-python3} -m megakernel.bench_serve_report "$OUT/bench_serve.json" \
  --plot "$OUT/bench_serve.png" --markdown "$OUT/bench_serve.md"
