"""Request models of the OpenAI API subset the server accepts (pydantic v2).

Every model forbids unknown fields, so a field this server does not implement is refused with a 400 that names
it instead of being silently ignored. Fields that OpenAI defines but whose semantics we cannot honour are either
absent (hence refused) or constrained to the values we can honour. OpenAI fields that change nothing for this
server (store, metadata, user, ...) are accepted and ignored.
Responses are plain dicts built in app.py (the official client parses them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 64
MAX_LOGPROBS = 20
INT64 = 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False      # vLLM's: usage in every chunk (guidellm, aiperf send it)


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchema(_Strict):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_\-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None               # honoured either way: the answer is decoded under the schema


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]


# ---- tools -----------------------------------------------------------------------------------------------------
class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None                # True: only with a forced tool_choice, whose calls are constrained


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


# ---- messages --------------------------------------------------------------------------------------------------
class TextPart(_Strict):
    type: Literal["text"]
    text: str


Content = Union[str, list[TextPart]]


class SystemMessage(_Strict):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: Content
    name: str | None = None


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class AssistantToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Content | None = None
    reasoning_content: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    name: str | None = None
    refusal: str | None = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ChatMessage = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage],
                        Field(discriminator="role")]


# ---- shared sampling fields ------------------------------------------------------------------------------------
class _Sampling(_Strict):
    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=-INT64 - 1, le=INT64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # OpenAI fields that change nothing here: accepted and ignored
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None            # prefix caching is automatic
    # extensions known from vLLM / SGLang
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    min_tokens: int | None = Field(default=None, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    return_tokens_as_token_ids: bool | None = None     # logprob tokens as "token_id:<id>"


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: None = None
    skip_special_tokens: bool | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None   # "none": no reasoning
    chat_template_kwargs: dict[str, Any] | None = None


def malformed_text(req: BaseModel) -> str | None:
    """The dotted path of the first string in `req` that is not valid Unicode (JSON's "\\ud800" escapes decode
    to lone surrogates, which no tokenizer or encoder accepts), or None."""

    def walk(node: Any, path: str) -> str | None:
        if isinstance(node, str):
            if node.isascii():       # a flag CPython keeps: no scan (encoding an 8 MB prompt took ~5 ms)
                return None
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return path or None
            return None
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            if isinstance(k, str) and walk(k, path) is not None:
                return f"{path}.{k}".lstrip(".")
            bad = walk(v, f"{path}.{k}".lstrip("."))
            if bad is not None:
                return bad
        return None

    return walk(req.model_dump(by_alias=True, exclude_none=True), "")
