"""A stream's text deltas (server/streaming.py's Tracker) look only at the text that is new: together they are the
whole reply with its special-token strings stripped, as stripping the whole text gave; no delta ends inside a
special-token string, an incomplete character or the stop-string hold-back."""

from __future__ import annotations

import random

import pytest

from megakernel.engine.outputs import CompletionOutput
from megakernel.north_format import strip_specials
from megakernel.server.streaming import Tracker

SPECIALS = sorted(["<|END_OF_TURN_TOKEN|>", "<|START_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>", "<EOS_TOKEN>", "<PAD>"],
                  key=len, reverse=True)


def _growing_text(rng: random.Random) -> list[str]:
    """Successive cumulative texts of one choice, growing by a token's worth of text (or a special) each step."""
    pieces = ["def ", "f(x)", ":\n", "<", "<|", "é", "\ufffd", "ab", " <b>", "|>"] + SPECIALS
    text, out = "", []
    for _ in range(rng.randint(1, 40)):
        text += rng.choice(pieces)
        if not text.endswith("\ufffd") or rng.random() < 0.5:
            out.append(text)
        else:          # a partial character completed by the next token
            text = text[:-1] + "ü"
            out.append(text)
    return out


@pytest.mark.parametrize("holdback", [0, 3])
@pytest.mark.parametrize("specials", [SPECIALS, None])
def test_deltas_add_up_to_the_stripped_reply(holdback, specials):
    rng = random.Random(holdback * 7 + (specials is None))
    for _ in range(500):
        texts = _growing_text(rng)
        tr = Tracker(holdback, specials)
        sent = ""
        for i, text in enumerate(texts):
            final = i == len(texts) - 1
            delta = tr.text_delta(CompletionOutput(0, [], text, "stop" if final else None), final)
            sent += delta
            if not final:
                cut = len(text) - holdback
                visible = strip_specials(text[:max(0, cut)], specials) if specials else text[:max(0, cut)]
                assert visible.startswith(sent), (texts, i)          # nothing past the hold-back, stripped alike
                assert not any(s in delta for s in specials or [])
        whole = strip_specials(texts[-1], specials) if specials else texts[-1]
        assert sent == whole, texts
        assert tr.sent_text == len(whole)
