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
    """About 3 minutes. Counts must be equal when each tool runs alone; side by side the test allows 25%, not the
    script's 10%: on this shared 2-vCPU machine, under other sessions' load, 60 s side by side left the mean TTFT
    up to 13% apart by chance (the committed results file is the 10% check). A broken TTFT or token count would be
    off by far more."""
    if not (REPO / ".lt-aiperf" / "bin" / "aiperf").exists():
        pytest.skip("aiperf not installed: run `bash scripts/bench_serve_crosscheck.sh` (it installs it)")
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_serve_crosscheck.py"), "16", "512", "32", "60"],
                       capture_output=True, text=True, timeout=1800, cwd=REPO,
                       env={**os.environ, "CROSSCHECK_RESULTS_DIR": str(tmp_path), "CROSSCHECK_TOLERANCE": "0.25"})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    (doc,) = [json.loads(f.read_text()) for f in tmp_path.glob("bench_serve_crosscheck_*.json")]
    assert doc["all_match"] and doc["tolerance"] == 0.25
    assert {r["mode"] for r in doc["runs"]} == {"alone", "side by side"}
    for r in doc["runs"]:
        if r["mode"] == "alone":
            assert r["ours"]["requests"] == r["aiperf"]["requests"] == 16
            assert r["ours"]["output_tokens"] == r["aiperf"]["output_tokens"] > 0
