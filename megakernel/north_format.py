"""The North chat format (Cohere's "command 4" style): parse model text into reasoning, answer and tool calls.

`<|START_THINKING|>...<|END_THINKING|>`, `<|START_TEXT|>...<|END_TEXT|>` and
`<|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}]<|END_ACTION|>` become reasoning, content and
OpenAI-style tool calls, incrementally. It uses cohere-melody's streaming filter (the parser the big engines
delegate to) when installed, otherwise a small pure-Python parser with the same output. Used by the server and by
`LLM.chat()`, so it depends on nothing but the standard library.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

START_THINKING, END_THINKING = "<|START_THINKING|>", "<|END_THINKING|>"
START_TEXT, END_TEXT = "<|START_TEXT|>", "<|END_TEXT|>"
START_ACTION, END_ACTION = "<|START_ACTION|>", "<|END_ACTION|>"
FORMAT_TOKENS = (START_THINKING, END_THINKING, START_TEXT, END_TEXT, START_ACTION, END_ACTION)


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def merge(self, other: "ParsedDelta") -> None:
        """Append `other` (the delta that follows this one)."""
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ChatParser:
    """Incremental North-format parser. Feed text deltas; read reasoning/content/tool-call deltas back.

    Tool-call deltas follow OpenAI's streaming shape: the first delta of a call carries its id and name (and
    empty arguments), later ones carry argument fragments.
    """

    def __init__(self, tools_enabled: bool, in_reasoning: bool, use_melody: bool = True,
                 tool_names: frozenset[str] | None = None) -> None:
        self.tools_enabled = tools_enabled
        self.tool_names = tool_names        # None: any name; else a call naming another tool is dropped
        self.in_reasoning = in_reasoning
        self._impl = _MelodyImpl(tools_enabled, in_reasoning) if use_melody and melody_available() else \
            _PyImpl(tools_enabled, in_reasoning)
        self._reasoning: list[str] = []     # pieces, joined when read: a feed costs what it adds, not the total
        self._content: list[str] = []
        self.calls: list[ToolCall] = []
        self._pending: dict[int, ToolCallDelta] = {}    # calls whose name is not known yet
        self._announced: set[int] = set()
        self._dropped: set[int] = set()                 # calls of names that are not tools

    @property
    def backend(self) -> str:
        return self._impl.name

    @property
    def reasoning(self) -> str:
        """The reasoning parsed so far."""
        return _joined(self._reasoning)

    @property
    def content(self) -> str:
        """The answer parsed so far."""
        return _joined(self._content)

    def feed(self, text: str) -> ParsedDelta:
        return self._absorb(self._impl.feed(text) if text else ParsedDelta())

    def finish(self) -> ParsedDelta:
        out = self._absorb(self._impl.finish())
        # calls still without a name are dropped; calls without arguments get "{}"
        for call in self.calls:
            if not call.arguments.strip():
                call.arguments = "{}"
                out.tool_calls.append(ToolCallDelta(self.calls.index(call), arguments="{}"))
        return out

    def _absorb(self, raw: ParsedDelta) -> ParsedDelta:
        out = ParsedDelta(raw.reasoning, raw.content)
        if raw.reasoning:
            self._reasoning.append(raw.reasoning)
        if raw.content:
            self._content.append(raw.content)
        for d in raw.tool_calls:
            if d.index in self._dropped:
                continue
            if d.index not in self._announced:
                p = self._pending.setdefault(d.index, ToolCallDelta(d.index))
                p.name = (p.name or "") + (d.name or "") if d.name else p.name
                p.arguments += d.arguments
                if p.name:
                    del self._pending[d.index]
                    if self.tool_names is not None and p.name not in self.tool_names:
                        self._dropped.add(d.index)
                        continue
                    self._announced.add(d.index)
                    call = ToolCall(new_tool_call_id(), p.name, p.arguments)
                    self.calls.append(call)
                    out.tool_calls.append(ToolCallDelta(len(self.calls) - 1, call.id, call.name, p.arguments))
                continue
            if d.name:   # a name arriving in pieces after the announcement (not seen with melody)
                continue
            k = self._call_slot(d.index)
            self.calls[k].arguments += d.arguments
            if d.arguments:
                out.tool_calls.append(ToolCallDelta(k, arguments=d.arguments))
        return out

    def _call_slot(self, raw_index: int) -> int:
        return sorted(self._announced).index(raw_index)


def _joined(parts: list[str]) -> str:
    """The pieces as one string; the list keeps just that string afterwards, so reading again costs nothing."""
    if len(parts) > 1:
        parts[:] = ["".join(parts)]
    return parts[0] if parts else ""


def melody_available() -> bool:
    try:
        import cohere_melody  # noqa: F401
    except ImportError:
        return False
    return True


class _MelodyImpl:
    name = "cohere-melody"

    def __init__(self, tools_enabled: bool, in_reasoning: bool) -> None:
        from cohere_melody import PyFilter, PyFilterOptions

        opts = PyFilterOptions().cmd4()
        if not tools_enabled:
            opts = opts.no_tools()
        if not in_reasoning:
            opts = opts.start_in_answer()
        self.f = PyFilter(opts)

    @staticmethod
    def _convert(r) -> ParsedDelta:
        return ParsedDelta(r.reasoning or "", r.content or "",
                           [ToolCallDelta(t.index, t.id or None, t.name or None, t.arguments or "")
                            for t in r.tool_calls])

    def feed(self, text: str) -> ParsedDelta:
        return self._convert(self.f.write_decoded(text))

    def finish(self) -> ParsedDelta:
        return self._convert(self.f.flush_partials())


_TAG = re.compile(r"<\|(START|END)_(THINKING|TEXT|ACTION)\|>")


class _PyImpl:
    """Fallback parser: a streaming state machine that looks at each character once. A trailing fragment that may
    start (or be) a format tag waits for the next delta; a tool call is emitted when its action closes (at the end,
    an unclosed action is parsed as it stands)."""

    name = "python"

    def __init__(self, tools_enabled: bool, in_reasoning: bool) -> None:
        self.tools_enabled = tools_enabled
        self.mode = "reasoning" if in_reasoning else "answer"
        self.held = ""                         # text not parsed yet: a possible partial tag
        self.action: list[str] | None = None   # the body of an open action
        self.n_calls = 0

    def _run(self, text: str, final: bool) -> ParsedDelta:
        text = self.held + text
        body = text if final else _hold_partial_tag(text)
        self.held = text[len(body):]
        reasoning: list[str] = []
        content: list[str] = []
        actions: list[str] = []
        pos = 0
        for m in _TAG.finditer(body):
            piece = body[pos:m.start()]
            pos = m.end()
            (self.action if self.action is not None else reasoning if self.mode == "reasoning" else content).append(
                piece)
            edge, kind = m.group(1), m.group(2)
            if kind == "THINKING":
                self.mode = "reasoning" if edge == "START" else "answer"
            elif kind == "ACTION" and self.tools_enabled:
                if edge == "START":
                    self.action = []
                elif self.action is not None:
                    actions.append("".join(self.action))
                    self.action = None
            elif kind == "ACTION":
                content.append(m.group(0))
        tail = body[pos:]
        if self.action is not None:
            self.action.append(tail)
            if final:
                actions.append("".join(self.action))
                self.action = None
        else:
            (reasoning if self.mode == "reasoning" else content).append(tail)
        out = ParsedDelta("".join(reasoning), "".join(content))
        for a in actions:
            for name, args in _parse_action(a):
                out.tool_calls.append(ToolCallDelta(self.n_calls, str(self.n_calls), name, args))
                self.n_calls += 1
        return out

    def feed(self, text: str) -> ParsedDelta:
        return self._run(text, False)

    def finish(self) -> ParsedDelta:
        return self._run("", True)


def _hold_partial_tag(text: str) -> str:
    """Cut a trailing fragment that may be the start of a format tag (completed by the next delta)."""
    i = text.rfind("<")
    if i != -1 and len(text) - i < max(map(len, FORMAT_TOKENS)):
        frag = text[i:]
        if any(t.startswith(frag) for t in FORMAT_TOKENS):
            return text[:i]
    return text


def _parse_action(body: str) -> list[tuple[str, str]]:
    try:
        items = json.loads(body)
    except json.JSONDecodeError:
        return []
    if isinstance(items, dict):
        items = [items]
    out = []
    for it in items if isinstance(items, list) else []:
        if isinstance(it, dict) and isinstance(it.get("tool_name"), str) and it["tool_name"]:
            params = it.get("parameters", {})
            out.append((it["tool_name"], json.dumps(params, ensure_ascii=False)))
    return out


def special_strings_to_strip(tokenizer) -> list[str]:
    """Special-token strings that are not part of the answer format (turn markers, BOS, PAD, ...)."""
    if tokenizer is None:
        return []
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok.content if hasattr(tok, "content") else tok))
    return sorted((s for s in specials if s and s not in FORMAT_TOKENS), key=len, reverse=True)


def strip_specials(text: str, specials: list[str]) -> str:
    for s in specials:
        if s in text:
            text = text.replace(s, "")
    return text


def reasoning_ban(tokenizer) -> dict[int, float]:
    """Logit bias that keeps a model told not to reason (the prompt does not open <|START_THINKING|>) from opening
    a reasoning block anyway."""
    if tokenizer is None:
        return {}
    ids = tokenizer.convert_tokens_to_ids([START_THINKING, END_THINKING])
    return {i: -100.0 for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id}


def split_reply(text: str, in_reasoning: bool, specials: list[str]) -> ParsedDelta:
    """A whole reply (decoded with its special tokens) as reasoning, answer and tool calls."""
    parser = ChatParser(tools_enabled=True, in_reasoning=in_reasoning)
    parser.feed(strip_specials(text, specials))
    parser.finish()
    return ParsedDelta(parser.reasoning, parser.content,
                       [ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(parser.calls)])
