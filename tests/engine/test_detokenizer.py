"""Incremental detokenization equals a full decode, token by token, on the embedded model's byte-level BPE.

At every step the incremental text is a prefix of the full decode of the tokens so far, and equal to it whenever
the full decode does not end inside a multi-byte character (there it waits for the next token).
"""

from __future__ import annotations

import random

import pytest

from megakernel.default_model import resolve_model_path
from megakernel.engine.detokenizer import DetokState, detokenize_step
from megakernel.engine.loader import load_tokenizer

TEXT = ("def naïve_sum(xs):\n    \"\"\"Σ of xs — 合計 🚀🚀 café\"\"\"\n    return sum(xs)  # ok ✓\n"
        "<|START_ACTION|>[{\"tool_name\": \"run\", \"parameters\": {}}]<|END_ACTION|>\n\tdone 😀 ñ ü ß")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


def _check(tokenizer, ids: list[int], skip: bool) -> None:
    st, inc = DetokState(), ""
    for n in range(1, len(ids) + 1):
        inc = detokenize_step(tokenizer, ids, n, inc, st, skip)
        full = tokenizer.decode(ids[:n], skip_special_tokens=skip)
        assert full.startswith(inc), (n, inc[-20:], full[-20:])
        if not full.endswith("\ufffd"):
            assert inc == full, n
    assert st.prefix_offset <= st.read_offset <= len(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_real_text(tokenizer, skip):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 40
    _check(tokenizer, ids, skip)


@pytest.mark.parametrize("seed", range(3))
def test_random_tokens(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(300)]
    _check(tokenizer, ids, skip=True)


def test_window_stays_short(tokenizer):
    """Work per token does not grow with the output: the decoded window stays a few tokens wide."""
    ids = tokenizer.encode(TEXT * 20, add_special_tokens=False)
    st, text = DetokState(), ""
    widest = 0
    for n in range(1, len(ids) + 1):
        text = detokenize_step(tokenizer, ids, n, text, st, True)
        widest = max(widest, n - st.prefix_offset)
    assert widest <= 8, widest
