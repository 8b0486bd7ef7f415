#!/usr/bin/env bash
# Set up (first run only) and serve the embedded default model on http://127.0.0.1:8000 (extra args pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh server
exec .venv/bin/megakernel serve "$@"
