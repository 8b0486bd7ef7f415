"""Prompt tokenisation bounded by the context length (request_params.encode_capped): the same ids as tokenising the
whole text, whenever the whole text fits, and the same first `cap` ids when it does not, while only a prefix of a
huge text is ever handed to the tokenizer (an encoding of millions of tokens holds the GIL while it is freed)."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from megakernel.server.request_params import CUT_SLACK_TOKENS, encode_capped


class CountingTokenizer:
    """The tokenizer, recording the length of every text it is asked to encode."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.lengths: list[int] = []

    def encode(self, text: str, **kw) -> list[int]:
        self.lengths.append(len(text))
        return self.tok.encode(text, **kw)


@pytest.fixture(scope="module")
def tok(model_path):
    t = AutoTokenizer.from_pretrained(str(model_path))
    t.model_max_length = 1 << 62
    return t


def texts(rng: random.Random) -> dict[str, str]:
    words = ["def", "return", "the", "  ", "\n", "x", "é", "漢字", "😀", "0.25", "{", "}", "    ", "über", "a" * 40]
    mixed = "".join(rng.choice(words) + rng.choice(["", " ", "  ", "\n"]) for _ in range(3000))
    return {"mixed": mixed, "words": "word " * 2000, "spaces": " " * 9000, "no_space": "ab" * 5000,
            "newlines": "x\n\n" * 3000, "cjk": "漢字テスト" * 1500, "digits": "0123456789" * 900}


@pytest.mark.parametrize("cap", [7, 100, 600, 1500, 4000])
@pytest.mark.parametrize("special", [True, False])
def test_same_ids_as_the_whole_text(tok, cap, special):
    for name, text in texts(random.Random(cap)).items():
        for cut in (len(text), len(text) // 3, 5000, 4097):
            t = text[:cut]
            full = tok.encode(t, add_special_tokens=special)
            got = encode_capped(tok, t, special, cap)
            assert got == full[:cap], (name, cut, cap, len(full), len(got))


def test_a_huge_text_is_tokenised_only_in_part(tok):
    cap = 512
    for text in ("word " * (8 * 1024 * 1024 // 5), " " * (8 << 20), "漢字テスト" * (1 << 20)):
        counting = CountingTokenizer(tok)
        ids = encode_capped(counting, text, True, cap)
        assert len(ids) == cap
        assert max(counting.lengths) <= 4 * 8 * cap, counting.lengths
        assert ids == tok.encode(text[:200_000], add_special_tokens=True)[:cap]


def test_a_prefix_that_yields_few_tokens_grows():
    class LongTokens:   # one token per 100 characters: the first prefix (8 per allowed token) is too short
        def __init__(self) -> None:
            self.lengths: list[int] = []

        def encode(self, text, add_special_tokens, truncation, max_length):
            self.lengths.append(len(text))
            return list(range(len(text) // 100))[:max_length]

    t = LongTokens()
    assert encode_capped(t, "x" * 10**7, False, 1000) == list(range(1000))
    assert t.lengths == [8000, 32000, 128000]
    assert encode_capped(LongTokens(), "x" * 50_000, False, 1000) == list(range(500))     # whole text, 500 tokens
    assert CUT_SLACK_TOKENS > 0


def test_the_cut_through_a_word_does_not_leak_into_the_ids(tok):
    """Caps whose first prefix (4096 characters at caps up to 512) ends inside a word, with that prefix's token count
    near the cap: the prefix's last tokens are pieces of the cut word, which the whole text does not have. (The small
    embedded vocabulary spends ~1 token on "function " and 2-3 on most other words, hence this one word, shifted so
    the cut falls at each of its letters.)"""
    for shift in range(9):
        text = "z" * shift + " " + "function " * 2000
        n = len(tok.encode(text[:4096], add_special_tokens=False))
        assert n <= 512
        full = tok.encode(text, add_special_tokens=False)
        for cap in range(n - CUT_SLACK_TOKENS - 8, n + 1):
            assert encode_capped(tok, text, False, cap) == full[:cap], (shift, cap, n)
