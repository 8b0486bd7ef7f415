"""The pure-Python North-format parser is a streaming state machine: every delta costs what it adds. It must say
exactly what the parser it replaced said, which re-parsed the whole text on every delta (kept here as the
reference), delta for delta, on random texts cut at random points."""

from __future__ import annotations

import json
import random

import pytest

from megakernel.north_format import (FORMAT_TOKENS, _TAG, ChatParser, ParsedDelta, ToolCallDelta, _hold_partial_tag,
                                     _parse_action, _PyImpl)


class _Rescan:
    """The former fallback parser: re-parses the accumulated text and emits the difference."""

    def __init__(self, tools_enabled: bool, in_reasoning: bool) -> None:
        self.tools_enabled, self.in_reasoning = tools_enabled, in_reasoning
        self.text = ""
        self.sent_reasoning = self.sent_content = self.sent_calls = 0

    def _parse(self, final: bool):
        mode = "reasoning" if self.in_reasoning else "answer"
        reasoning, content, actions = [], [], []
        pos = 0
        action = None
        text = self.text if final else _hold_partial_tag(self.text)
        for m in _TAG.finditer(text):
            piece = text[pos:m.start()]
            pos = m.end()
            (action if action is not None else reasoning if mode == "reasoning" else content).append(piece)
            edge, kind = m.group(1), m.group(2)
            if kind == "THINKING":
                mode = "reasoning" if edge == "START" else "answer"
            elif kind == "ACTION" and self.tools_enabled:
                if edge == "START":
                    action = []
                elif action is not None:
                    actions.append("".join(action))
                    action = None
            elif kind == "ACTION":
                content.append(m.group(0))
        tail = text[pos:]
        if action is not None:
            action.append(tail)
            if final:
                actions.append("".join(action))
        else:
            (reasoning if mode == "reasoning" else content).append(tail)
        calls = [c for a in actions for c in _parse_action(a)]
        return "".join(reasoning), "".join(content), calls

    def _delta(self, final: bool) -> ParsedDelta:
        reasoning, content, calls = self._parse(final)
        out = ParsedDelta(reasoning[self.sent_reasoning:], content[self.sent_content:])
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        for i, (name, args) in enumerate(calls[self.sent_calls:], start=self.sent_calls):
            out.tool_calls.append(ToolCallDelta(i, str(i), name, args))
        self.sent_calls = len(calls)
        return out

    def feed(self, text: str) -> ParsedDelta:
        self.text += text
        return self._delta(False)

    def finish(self) -> ParsedDelta:
        return self._delta(True)


def _random_text(rng: random.Random) -> str:
    words = ["plan ", "x = 1\n", "<", "<|", "|>", "a<b ", "é", "\ufffd", "{", "}", " ", "<|START", "_TEXT"]
    call = json.dumps([{"tool_call_id": "0", "tool_name": rng.choice(["f", "get_time", ""]),
                        "parameters": {"k": rng.randint(0, 9)}}])
    pieces = []
    for _ in range(rng.randint(1, 30)):
        r = rng.random()
        pieces.append(rng.choice(FORMAT_TOKENS) if r < 0.3 else call if r < 0.4 else rng.choice(words))
    return "".join(pieces)


@pytest.mark.parametrize("tools", [True, False])
@pytest.mark.parametrize("in_reasoning", [True, False])
def test_streaming_parser_says_what_the_rescanning_one_said(tools, in_reasoning):
    rng = random.Random(hash((tools, in_reasoning)) & 0xFFFF)
    for _ in range(400):
        text = _random_text(rng)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 \
            else []
        new, old = _PyImpl(tools, in_reasoning), _Rescan(tools, in_reasoning)
        for a, b in zip([0] + cuts, cuts + [len(text)]):
            assert new.feed(text[a:b]) == old.feed(text[a:b]), (text, cuts)
        assert new.finish() == old.finish(), (text, cuts)


def test_parser_accumulates_what_it_emitted():
    p = ChatParser(tools_enabled=True, in_reasoning=True, use_melody=False)
    text = "think<|END_THINKING|><|START_TEXT|>answer<|END_TEXT|>"
    for ch in text:
        p.feed(ch)
    p.finish()
    assert (p.reasoning, p.content) == ("think", "answer")
    assert (p.reasoning, p.content) == ("think", "answer")      # read twice: same strings
