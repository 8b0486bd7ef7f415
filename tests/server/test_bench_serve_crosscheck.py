"""`megakernel bench serve` against aiperf, unchanged, on the same workload and server (issue 13's cross-check):
runs scripts/bench_serve_crosscheck.py when scripts/bench_serve_crosscheck.sh has installed aiperf (its own venv,
.lt-aiperf); skipped otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server_harness import REPO

pytestmark = [pytest.mark.slow, pytest.mark.loadtools]


def test_bench_serve_agrees_with_aiperf(tmp_path):
    if not (REPO / ".lt-aiperf" / "bin" / "aiperf").exists():
        pytest.skip("aiperf not installed: run `bash scripts/bench_serve_crosscheck.sh` (it installs it)")
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_serve_crosscheck.py"), "16", "256", "32", "12"],
                       capture_output=True, text=True, timeout=1800, cwd=REPO,
                       env={**os.environ, "CROSSCHECK_RESULTS_DIR": str(tmp_path)})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    (doc,) = [json.loads(f.read_text()) for f in tmp_path.glob("bench_serve_crosscheck_*.json")]
    assert doc["all_match"] and {r["mode"] for r in doc["runs"]} == {"alone", "side by side"}
