"""Chat: render messages and tools with the checkpoint's chat template; parse North-format model text.

Rendering uses transformers' `apply_chat_template` (the checkpoint's chat_template.jinja or the template in
tokenizer_config.json). tool_choice "required" or a named function, and response_format, are enforced by
constrained decoding (structured.py). With "auto", a call naming a function that is not in `tools` is dropped.

Parsing North-format text into reasoning_content, content and tool calls lives in megakernel/north_format.py
(shared with `LLM.chat()`); its names are re-exported here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from megakernel.errors import RequestError
from megakernel.north_format import (END_THINKING, START_THINKING, ChatParser, ParsedDelta,  # noqa: F401
                                     ToolCall, ToolCallDelta, melody_available, special_strings_to_strip,
                                     strip_specials)
from megakernel.server.protocol import ChatCompletionRequest, NamedToolChoice
from megakernel.server.structured import Constraint, chat_constraint

_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


class ChatRequestError(RequestError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# ---- rendering -------------------------------------------------------------------------------------------------
@dataclass
class RenderedChat:
    prompt: str                  # the full prompt text
    tools_enabled: bool          # parse <|START_ACTION|> into tool calls
    in_reasoning: bool           # the prompt leaves the model inside <|START_THINKING|>
    constraint: Constraint | None = None     # the grammar the answer must follow (structured outputs)
    tool_names: frozenset[str] = frozenset()  # a parsed call naming anything else is not a tool call
    reasoning_off: bool = False  # the template was told not to reason: reasoning tokens are banned


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
    if req.reasoning_effort is not None and "reasoning" not in kwargs and "enable_thinking" not in kwargs:
        kwargs["reasoning"] = req.reasoning_effort != "none"
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
    names = frozenset(t.function.name for t in req.tools or []) if tools_enabled else frozenset()
    return RenderedChat(prompt, tools_enabled, in_reasoning, chat_constraint(req, tools_enabled, in_reasoning), names,
                        reasoning_off=not in_reasoning)
