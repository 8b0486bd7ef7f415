"""A test directory whose packages are missing is skipped visibly, and in CI the run fails instead."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from requirements_check import MissingTestDependency, require


def test_nothing_missing_changes_nothing():
    require(["json", "pytest"], "these tests", env={"CI": "true"})


def test_missing_package_skips_with_the_reason():
    with pytest.raises(pytest.skip.Exception, match="the server tests need no_such_pkg_1234"):
        require(["json", "no_such_pkg_1234"], "the server tests", env={})


@pytest.mark.parametrize("ci", ["true", "1", "True"])
def test_missing_package_fails_in_ci(ci):
    with pytest.raises(MissingTestDependency, match="no_such_pkg_1234"):
        require(["no_such_pkg_1234"], "the server tests", env={"CI": ci})


@pytest.mark.slow
def test_a_run_reports_the_skip_and_ci_fails(tmp_path):
    """End to end through pytest: the skipped directory is in the summary; with CI=true the run errors out."""
    sub = tmp_path / "t" / "srv"
    sub.mkdir(parents=True)
    (sub / "conftest.py").write_text(textwrap.dedent("""
        from requirements_check import require
        require(["no_such_pkg_1234"], "the server tests")
        import no_such_pkg_1234
    """))
    (sub / "test_srv.py").write_text("import no_such_pkg_1234\ndef test_x():\n    pass\n")
    (tmp_path / "t" / "test_other.py").write_text("def test_y():\n    pass\n")
    tests_dir = str(Path(__file__).parent)
    run = lambda env: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path / "t")], capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**env, "PYTHONPATH": tests_dir})
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    ok = run(env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "SKIPPED [1]" in ok.stdout and "the server tests need no_such_pkg_1234" in ok.stdout
    assert "1 passed, 1 skipped" in ok.stdout
    ci = run({**env, "CI": "true"})
    assert ci.returncode != 0 and "CI run without the packages the tests need" in ci.stdout + ci.stderr
