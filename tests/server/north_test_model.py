"""The model the server tests run on: the embedded north_nano (a trained North-format model with tokenizer and
chat template), unless MEGAKERNEL_TEST_SERVER_MODEL names another folder."""

from __future__ import annotations

import os
from pathlib import Path

from megakernel.default_model import EMBEDDED


def test_model_path() -> Path:
    env = os.environ.get("MEGAKERNEL_TEST_SERVER_MODEL")
    return Path(env) if env else EMBEDDED
