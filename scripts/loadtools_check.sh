#!/usr/bin/env bash
# Run guidellm and aiperf from the package index, unchanged, against a fresh `megakernel serve` of the embedded
# model (streaming chat and completions, concurrency 1 and 4), and check each run against the server's /metrics:
# 0 failed requests, the same request and token counts. Each tool gets its own venv (.lt-guidellm, .lt-aiperf:
# large, with pins of their own, so not in the test extra). Writes benchmarks/results/loadtools_<date>.{json,md}.
# Usage: bash scripts/loadtools_check.sh [requests per run, default 24]
set -euo pipefail
cd "$(dirname "$0")/.."
GUIDELLM_VERSION=${GUIDELLM_VERSION:-0.8.1}
AIPERF_VERSION=${AIPERF_VERSION:-0.13.0}
bash scripts/setup.sh server
for tool in guidellm aiperf; do
    venv=.lt-$tool
    want=$([ $tool = guidellm ] && echo "$GUIDELLM_VERSION" || echo "$AIPERF_VERSION")
    if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$tool') != '$want')" \
            2>/dev/null; then
        echo "installing $tool==$want into $venv (log: $venv.log)..." >&2
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install -q "$tool==$want" > "$venv.log" 2>&1 || { tail -20 "$venv.log"; exit 1; }
    fi
done
PYTHONPATH="$PWD/tests/server${PYTHONPATH:+:$PYTHONPATH}" exec .venv/bin/python scripts/loadtools_check.py "$@"
