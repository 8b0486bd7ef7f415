"""Chat: render messages and tools with the checkpoint's chat template; parse North-format model text.

Rendering uses transformers' `apply_chat_template` (the checkpoint's chat_template.jinja or the template in
tokenizer_config.json). tool_choice is enforced by prompt forcing: "required" and a named function prefill the
assistant turn up to the tool name (or the parameters), so the model must call a tool.

Parsing turns `<|START_THINKING|>...<|END_THINKING|>`, `<|START_TEXT|>...<|END_TEXT|>` and
`<|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}]<|END_ACTION|>` into reasoning_content, content and
OpenAI tool calls, incrementally. It uses cohere-melody's streaming filter (the parser the big engines delegate to)
when installed, otherwise a small pure-Python parser with the same output.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from megakernel.errors import RequestError
from megakernel.server.protocol import ChatCompletionRequest, NamedToolChoice

START_THINKING, END_THINKING = "<|START_THINKING|>", "<|END_THINKING|>"
START_TEXT, END_TEXT = "<|START_TEXT|>", "<|END_TEXT|>"
START_ACTION, END_ACTION = "<|START_ACTION|>", "<|END_ACTION|>"
FORMAT_TOKENS = (START_THINKING, END_THINKING, START_TEXT, END_TEXT, START_ACTION, END_ACTION)

_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


class ChatRequestError(RequestError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# ---- rendering -------------------------------------------------------------------------------------------------
@dataclass
class RenderedChat:
    prompt: str                  # the full prompt text (forced prefix included)
    forced: str                  # model-side text the server prefilled (fed to the parser before the output)
    tools_enabled: bool          # parse <|START_ACTION|> into tool calls
    in_reasoning: bool           # the prompt leaves the model inside <|START_THINKING|>


def validate_tools(req: ChatCompletionRequest) -> None:
    names: set[str] = set()
    for i, tool in enumerate(req.tools or []):
        f = tool.function
        if f.name in names:
            raise ChatRequestError(f"duplicate tool name {f.name!r}", f"tools.{i}.function.name")
        names.add(f.name)
        if f.parameters is not None:
            _check_schema(f.parameters, f"tools.{i}.function.parameters")
    choice = req.tool_choice
    if choice is not None and choice != "none" and not req.tools:
        raise ChatRequestError("tool_choice needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ChatRequestError(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                               "tool_choice")


def _check_schema(schema: dict[str, Any], param: str) -> None:
    t = schema.get("type", "object")
    if t != "object":
        raise ChatRequestError(f"invalid tool schema: parameters must be a JSON Schema of type 'object', got "
                               f"{t!r}", param)
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
        raise ChatRequestError("invalid tool schema: 'properties' must map names to schemas", param)
    req = schema.get("required", [])
    if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
        raise ChatRequestError("invalid tool schema: 'required' must be a list of property names", param)
    try:
        import jsonschema
    except ImportError:
        _check_types(schema, param)
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ChatRequestError(f"invalid tool schema: {e.message}", param) from None
    except Exception as e:  # malformed $schema, unresolvable refs, ...
        raise ChatRequestError(f"invalid tool schema: {e}", param) from None


def _check_types(node: Any, param: str) -> None:
    if isinstance(node, dict):
        t = node.get("type")
        ts = t if isinstance(t, list) else [t] if t is not None else []
        if any(not isinstance(x, str) or x not in _JSON_TYPES for x in ts):
            raise ChatRequestError(f"invalid tool schema: unknown type {t!r}", param)
        for v in node.values():
            _check_types(v, param)
    elif isinstance(node, list):
        for v in node:
            _check_types(v, param)


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content)


def messages_for_template(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        d: dict[str, Any] = {"role": role, "content": _text(m.content)}
        if m.role == "assistant":
            if m.reasoning_content:
                d["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                calls = []
                for tc in m.tool_calls:
                    try:
                        args: Any = json.loads(tc.function.arguments) if tc.function.arguments.strip() else {}
                    except json.JSONDecodeError:
                        args = tc.function.arguments
                    calls.append({"id": tc.id, "type": "function",
                                  "function": {"name": tc.function.name, "arguments": args}})
                d["tool_calls"] = calls
        elif m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def render_chat(tokenizer, req: ChatCompletionRequest) -> RenderedChat:
    if tokenizer is None:
        raise ChatRequestError("this model has no tokenizer, so it cannot serve chat; use /v1/completions with "
                               "token ids", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise ChatRequestError("this model has no chat template; use /v1/completions", "messages")
    validate_tools(req)
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    tools_enabled = bool(req.tools) and choice != "none"
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if tools_enabled else None
    kwargs = dict(req.chat_template_kwargs or {})
    for k in ("messages", "tools", "add_generation_prompt", "tokenize", "conversation", "continue_final_message",
              "return_dict", "chat_template"):
        if k in kwargs:
            raise ChatRequestError(f"chat_template_kwargs may not set {k!r}", "chat_template_kwargs")
    try:
        prompt = tokenizer.apply_chat_template(messages_for_template(req), tools=tools, add_generation_prompt=True,
                                               tokenize=False, **kwargs)
    except Exception as e:  # jinja2 TemplateError (raise_exception in the template), bad kwargs, ...
        raise ChatRequestError(f"the chat template rejected the conversation: {e}", "messages") from None
    if not isinstance(prompt, str):
        prompt = prompt[0] if isinstance(prompt, list) else str(prompt)
    in_reasoning = prompt.endswith(START_THINKING)
    forced = ""
    if tools_enabled and (choice == "required" or isinstance(choice, NamedToolChoice)):
        forced = (END_THINKING if in_reasoning else "") + START_ACTION + '[{"tool_call_id": "0", "tool_name": "'
        if isinstance(choice, NamedToolChoice):
            forced += choice.function.name + '", "parameters": '
    return RenderedChat(prompt + forced, forced, tools_enabled, in_reasoning)


# ---- parsing ---------------------------------------------------------------------------------------------------
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

    def __init__(self, tools_enabled: bool, in_reasoning: bool, use_melody: bool = True) -> None:
        self.tools_enabled = tools_enabled
        self.in_reasoning = in_reasoning
        self._impl = _MelodyImpl(tools_enabled, in_reasoning) if use_melody and melody_available() else \
            _PyImpl(tools_enabled, in_reasoning)
        self.reasoning = ""
        self.content = ""
        self.calls: list[ToolCall] = []
        self._pending: dict[int, ToolCallDelta] = {}    # calls whose name is not known yet
        self._announced: set[int] = set()

    @property
    def backend(self) -> str:
        return self._impl.name

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
        self.reasoning += raw.reasoning
        self.content += raw.content
        for d in raw.tool_calls:
            if d.index not in self._announced:
                p = self._pending.setdefault(d.index, ToolCallDelta(d.index))
                p.name = (p.name or "") + (d.name or "") if d.name else p.name
                p.arguments += d.arguments
                if p.name:
                    self._announced.add(d.index)
                    del self._pending[d.index]
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
    """Fallback parser: re-parses the accumulated text and emits the difference (tool calls when complete)."""

    name = "python"

    def __init__(self, tools_enabled: bool, in_reasoning: bool) -> None:
        self.tools_enabled = tools_enabled
        self.in_reasoning = in_reasoning
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.sent_calls = 0

    def _parse(self, final: bool):
        mode = "reasoning" if self.in_reasoning else "answer"
        reasoning, content, actions = [], [], []
        pos = 0
        action: list[str] | None = None
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
        calls = []
        for a in actions:
            calls.extend(_parse_action(a))
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
