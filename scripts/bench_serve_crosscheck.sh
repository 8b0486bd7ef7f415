#!/usr/bin/env bash
# Cross-check `megakernel bench serve` against aiperf (from the package index, run unchanged) on the same workload
# and server (the embedded model on CPU): request count, output tokens and TTFT within 10%. aiperf gets its own
# venv (.lt-aiperf, as scripts/loadtools_check.sh makes it). Writes
# benchmarks/results/bench_serve_crosscheck_<date>.{json,md} (about 6 minutes; the method: the .py's docstring).
# Usage: bash scripts/bench_serve_crosscheck.sh [requests per run, default 32] [prompt tokens, 512]
#                                               [output tokens, 32] [seconds side by side, 60]
set -euo pipefail
cd "$(dirname "$0")/.."
AIPERF_VERSION=${AIPERF_VERSION:-0.13.0}
bash scripts/setup.sh server,test
venv=.lt-aiperf
if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('aiperf') != '$AIPERF_VERSION')" \
        2>/dev/null; then
    echo "installing aiperf==$AIPERF_VERSION into $venv (log: $venv/pip-install.log)..." >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q "aiperf==$AIPERF_VERSION" > "$venv/pip-install.log" 2>&1 ||
        { tail -20 "$venv/pip-install.log"; exit 1; }
fi
exec .venv/bin/python scripts/bench_serve_crosscheck.py "$@"
