#!/usr/bin/env bash
# Fetch into .whl/ (git-ignored) the wheels `megakernel serve` needs on the device machine, whose image lacks them
# (Python 3.12, x86_64): the server extra with the versions the CPU venv runs, plus what those need and the image
# may lack or hold too old (opentelemetry-api for fastapi, anyio and typing-extensions new enough). About 12 MB.
# Carry it with `carry: [".whl"]`; scripts/gpu_bench_serve.sh installs it into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic-core==2.46.4
annotated-types==0.7.0 annotated-doc==0.0.7 typing-inspection==0.4.2 typing-extensions==4.16.0 anyio==4.16.0
opentelemetry-api==1.45.2 prometheus-client==0.26.0 llguidance==1.9.1 jsonschema==4.26.0
jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0 orjson==3.13.0 httptools==0.9.0 uvloop==0.23.0"
mkdir -p .whl
for w in $WHEELS; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$w" \
    2>&1 | grep -v "^WARNING: Location" || true
done
ls .whl && du -sh .whl
