"""guidellm and aiperf, unchanged, against the server (issue 14, item 9 and "how it is checked"): runs
scripts/loadtools_check.py when scripts/loadtools_check.sh has installed the tools (their own venvs: too large, with
pins of their own, for the test extra); skipped otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from server_harness import REPO

pytestmark = [pytest.mark.slow, pytest.mark.loadtools]


def test_load_tools_match_metrics(tmp_path):
    missing = [t for t in ("guidellm", "aiperf") if not (REPO / f".lt-{t}" / "bin" / t).exists()]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: run `bash scripts/loadtools_check.sh` (it installs them)")
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "loadtools_check.py"), "8"], capture_output=True,
                       text=True, timeout=1800, cwd=REPO, env={**os.environ, "LOADTOOLS_RESULTS_DIR": str(tmp_path),
                                                            "PYTHONPATH": str(REPO / "tests" / "server")})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
