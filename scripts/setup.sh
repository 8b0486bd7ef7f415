#!/usr/bin/env bash
# Create .venv (once) and install megakernel with the extras named in $1 (e.g. "server" or "server,test").
# torch is pinned to 2.13.0 so a CPU machine takes the CPU wheel; a GPU machine's existing torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-server}
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv --system-site-packages .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -c 'import torch' 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[${extras}]"
