"""Test directories that need optional packages: without them the directory is skipped, and the skip shows in the
summary; in CI (`CI=true`) a missing package is an error, so a CI run never passes by silently testing less."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

import pytest


class MissingTestDependency(RuntimeError):
    """A package the tests need is not installed where they must run (CI)."""


def missing(modules: list[str]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require(modules: list[str], what: str, env: Mapping[str, str] = os.environ) -> None:
    """Call from a conftest.py at module level: skip the directory's tests when a module is missing (in CI: raise)."""
    gone = missing(modules)
    if not gone:
        return
    why = f"{what} need {', '.join(gone)} (pip install -e '.[server,test]' or bash scripts/setup.sh server,test)"
    if env.get("CI", "").lower() in ("1", "true", "yes"):
        raise MissingTestDependency(f"CI run without the packages the tests need: {why}")
    pytest.skip(why, allow_module_level=True)
