#!/usr/bin/env bash
# Create .venv (once) and install megakernel with the extras named in $1 (e.g. "server" or "server,test").
# torch is pinned to 2.13.0 so a CPU machine takes the CPU wheel; a GPU machine's existing torch is kept.
# Once installed, later runs skip pip while pyproject.toml and the extras are unchanged (a stamp in .venv), and
# pip's output goes to .venv/setup.log (shown only if it fails).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-server}
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv --system-site-packages .venv
fi
key=$( (cat pyproject.toml; echo "$extras") | sha256sum | cut -c1-16)
stamp=.venv/.megakernel-installed-$key
if [ -f "$stamp" ] && .venv/bin/python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("megakernel") is None)'; then
    exit 0
fi
log=.venv/setup.log
echo "setting up .venv (extras: $extras; log: $log)..." >&2
if ! {
    .venv/bin/python -m pip install -q --upgrade pip &&
    { .venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"; } &&
    .venv/bin/python -m pip install -q -e ".[${extras}]"
} > "$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "setup failed: see $log" >&2
    exit 1
fi
touch "$stamp"
