"""Live servers for the server tests: `megakernel serve` subprocesses on 127.0.0.1 (free ports).

server        the normal configuration (API key required, prefix caching, batch 16)
tight_server  a KV budget so small that a busy batch must preempt (recompute) sequences
"""

from __future__ import annotations

from pathlib import Path

import pytest

from requirements_check import require

# Without the server packages (e.g. on the GPU machine) the directory is skipped, and the summary says why; in CI
# that is an error.
require(["fastapi", "uvicorn", "openai", "httpx", "prometheus_client"], "the server tests")

from north_test_model import test_model_path  # noqa: E402
from server_harness import TIGHT_ARGS, LiveServer  # noqa: E402


@pytest.fixture(scope="session")
def model_path() -> Path:
    return test_model_path()


@pytest.fixture(scope="session")
def server(model_path, tmp_path_factory):
    s = LiveServer(["--model", str(model_path), "--block-size", "16", "--max-model-len", "512",
                    "--max-batch-size", "16", "--kv-cache-memory", "64M"], tmp_path_factory.mktemp("srv") / "log")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def tight_server(model_path, tmp_path_factory):
    s = LiveServer(["--model", str(model_path), *TIGHT_ARGS], tmp_path_factory.mktemp("tight") / "log")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client()
