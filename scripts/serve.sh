#!/usr/bin/env bash
# Set up (first run only) and serve the embedded default model on http://127.0.0.1:8000 (extra args pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh server
echo "megakernel is installed in $PWD/.venv: run 'source .venv/bin/activate' for the 'megakernel' command" \
     "(or call .venv/bin/megakernel)" >&2
exec .venv/bin/megakernel serve "$@"
