"""POST /v1/chat/completions: render the conversation, generate, and parse the North-format reply into reasoning,
content and tool calls (streamed as deltas, or whole)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import Response

from megakernel.engine.outputs import CompletionOutput, RequestOutput
from megakernel.engine.sampling_params import SamplingParams
from megakernel.errors import RequestError
from megakernel.north_format import reasoning_ban
from megakernel.server import chat as chatmod
from megakernel.server.async_engine import EngineDeadError, RequestFailed
from megakernel.server.errors import APIError
from megakernel.server.logprobs import chat_logprobs
from megakernel.server.protocol import ChatCompletionRequest
from megakernel.server.request_params import (check_model, check_prompt_ids, encode, resolve_max_tokens,
                                              sampling_params, stop_holdback)
from megakernel.server.responses import finish_reason, usage, usage_modes, usage_of, visible_tokens
from megakernel.server.sse import SSE_DONE, sse, stream_error_end, stream_response
from megakernel.server.state import ServerState
from megakernel.server.streaming import Tracker, collect_finals, merge


def _tool_call_json(d: chatmod.ToolCallDelta) -> dict[str, Any]:
    if d.id is not None:
        return {"index": d.index, "id": d.id, "type": "function",
                "function": {"name": d.name, "arguments": d.arguments}}
    return {"index": d.index, "function": {"arguments": d.arguments}}


@dataclass
class _PreparedChat:
    rendered: chatmod.RenderedChat
    ids: list[int]
    grammar: str | None          # the compiled constraint, checked up front


def _prepare_chat(state: ServerState, req: ChatCompletionRequest) -> _PreparedChat:
    """Render, tokenise and compile the constraint of a chat request (on a prep thread)."""
    try:
        rendered = chatmod.render_chat(state.worker_tokenizer, req)
    except chatmod.ChatRequestError as e:
        raise APIError(400, str(e), e.param) from None
    grammar = None
    if rendered.constraint is not None:
        if state.grammar is None:
            raise APIError(400, "this engine cannot constrain outputs", rendered.constraint.param)
        try:
            grammar = state.grammar.check(rendered.constraint.spec)
        except RequestError as e:
            raise APIError(400, f"{rendered.constraint.param}: {e}", rendered.constraint.param) from None
    ids = encode(state, rendered.prompt, False)
    check_prompt_ids(state, ids, "messages")
    return _PreparedChat(rendered, ids, grammar)


def _check_strict_tools(req: ChatCompletionRequest) -> None:
    forced = req.tool_choice == "required" or isinstance(req.tool_choice, chatmod.NamedToolChoice)
    for i, t in enumerate(req.tools or []):
        if t.function.strict and not forced:
            raise APIError(400, "strict tools need tool_choice 'required' or a named function (the calls are then "
                           "decoded under the schemas); with 'auto' adherence is not guaranteed",
                           f"tools.{i}.function.strict")


def _chat_finish(o: CompletionOutput, called: bool) -> str | None:
    reason = finish_reason(o.finish_reason)
    return "tool_calls" if called and reason == "stop" else reason


async def chat_completions(state: ServerState, req: ChatCompletionRequest, raw: Request):
    check_model(state, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    _check_strict_tools(req)
    if state.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot serve chat; use /v1/completions with token "
                       "ids", "messages")
    prep = await state.off_loop(_prepare_chat, state, req)
    rendered, ids = prep.rendered, prep.ids
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(state, len(ids), max_tokens, param)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(state, req, max_tokens=max_tokens, logprobs=logprobs, skip_special_tokens=False)
    if rendered.reasoning_off:
        params.logit_bias = {**reasoning_ban(state.tokenizer), **params.logit_bias}
    if rendered.constraint is not None:
        params.structured_outputs = rendered.constraint.spec
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    gen = state.engine.generate(rid, ids, params)
    single_call = req.parallel_tool_calls is False
    as_ids = bool(req.return_tokens_as_token_ids)

    def new_parser() -> chatmod.ChatParser:
        return chatmod.ChatParser(rendered.tools_enabled, rendered.in_reasoning, tool_names=rendered.tool_names)

    if req.stream:
        return stream_response(_stream(state, req, params, gen, len(ids), new_parser, rid, created, logprobs,
                                       single_call, as_ids))

    finals = await collect_finals(raw, [gen])
    if finals is None:
        return Response(status_code=499)
    final = finals[0]
    choices = []
    completion_tokens = 0
    for o in sorted(final.outputs, key=lambda o: o.index):
        completion_tokens += len(o.token_ids)
        parser = new_parser()
        parser.feed(chatmod.strip_specials(o.text, state.specials))
        parser.finish()
        calls = parser.calls[:1] if single_call else parser.calls
        msg: dict[str, Any] = {"role": "assistant", "content": parser.content if (parser.content or not calls)
                               else None}
        if parser.reasoning:
            msg["reasoning_content"] = parser.reasoning
        if calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        vis = visible_tokens(state, o, params)
        lp = chat_logprobs(state, o.token_ids[:vis], o.logprobs[:vis], logprobs, as_ids) \
            if logprobs is not None and o.logprobs is not None else None
        choices.append({"index": o.index, "message": msg, "logprobs": lp,
                        "finish_reason": _chat_finish(o, bool(calls)), "stop_reason": o.stop_reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": req.model, "choices": choices,
            "usage": usage(len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens)}


async def _stream(state: ServerState, req: ChatCompletionRequest, params: SamplingParams, gen, n_prompt: int,
                  new_parser: Callable[[], chatmod.ChatParser], rid: str, created: int, logprobs: int | None,
                  single_call: bool, as_ids: bool):
    n = params.n
    include_usage, continuous = usage_modes(req)
    holdback = stop_holdback(params)
    trackers = [Tracker(holdback, state.specials) for _ in range(n)]
    parsers = [new_parser() for _ in range(n)]
    done = [False] * n
    last: RequestOutput | None = None

    def chunk(choices):
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "choices": choices}
        if continuous:
            body["usage"] = usage_of([last]) if last is not None else usage(n_prompt, 0, 0)
        return sse(body)

    def delta_json(d: chatmod.ParsedDelta) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if d.reasoning:
            out["reasoning_content"] = d.reasoning
        if d.content:
            out["content"] = d.content
        calls = [c for c in d.tool_calls if not single_call or c.index == 0]
        if calls:
            out["tool_calls"] = [_tool_call_json(c) for c in calls]
        return out

    # the role comes first, before any generation (as OpenAI does)
    yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for j in range(n)])
    try:
        async for _, out in merge([gen]):
            last = out
            choices = []
            for o in out.outputs:
                j = o.index
                if done[j]:
                    continue
                final = o.finish_reason is not None
                p = parsers[j]
                d = p.feed(trackers[j].text_delta(o, final))
                if final:
                    d.merge(p.finish())
                ids, lps = trackers[j].token_delta(o, visible_tokens(state, o, params) if final
                                                   else len(o.token_ids))
                lp = chat_logprobs(state, ids, lps, logprobs, as_ids) if logprobs is not None and lps else None
                dj = delta_json(d)
                if not (dj or lp or final):
                    continue
                # one entry per choice per chunk: the last delta carries the finish reason itself
                entry = {"index": j, "delta": dj, "logprobs": lp, "finish_reason": None}
                if final:
                    done[j] = True
                    entry.update(finish_reason=_chat_finish(o, bool(p.calls)), stop_reason=o.stop_reason)
                choices.append(entry)
            if choices:
                yield chunk(choices)
    except (RequestError, EngineDeadError, RequestFailed) as e:
        yield stream_error_end(e)
        return
    if include_usage and last is not None:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                   "choices": [], "usage": usage_of([last])})
    yield SSE_DONE
