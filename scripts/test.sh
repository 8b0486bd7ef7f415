#!/usr/bin/env bash
# Set up (first run only) and run the test suite (GPU tests skip without a GPU). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh server,test
exec .venv/bin/python -m pytest -q "$@"
