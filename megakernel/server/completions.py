"""POST /v1/completions: prompts (text or token ids, one or many) x n completions, streamed or whole."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from megakernel.engine.outputs import RequestOutput
from megakernel.engine.sampling_params import SamplingParams
from megakernel.errors import RequestError
from megakernel.server.async_engine import EngineDeadError, RequestFailed
from megakernel.server.errors import APIError
from megakernel.server.logprobs import completion_logprobs
from megakernel.server.protocol import CompletionRequest
from megakernel.server.request_params import (check_model, check_prompt_ids, encode, resolve_max_tokens,
                                              sampling_params, stop_holdback)
from megakernel.server.responses import finish_reason, usage, usage_modes, usage_of, visible_tokens
from megakernel.server.sse import SSE_DONE, sse, stream_error_end, stream_response
from megakernel.server.state import ServerState
from megakernel.server.streaming import Tracker, collect_finals, merge

MAX_SEQS_PER_REQUEST = 256


def _encode_prompts(state: ServerState, prompts: list) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) of each prompt, checked (on a prep thread)."""
    items = [(pr, encode(state, pr, True)) if isinstance(pr, str) else (None, [int(t) for t in pr])
             for pr in prompts]
    for i, (_, ids) in enumerate(items):
        check_prompt_ids(state, ids, "prompt" if len(prompts) == 1 else f"prompt.{i}")
    return items


async def completions(state: ServerState, req: CompletionRequest, raw: Request):
    check_model(state, req)
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise APIError(400, "best_of != n is not supported (no server-side ranking)", "best_of")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
    p = req.prompt
    if isinstance(p, str):
        prompts: list[Any] = [p]
    elif p and isinstance(p[0], list):
        prompts = list(p)
    elif p and isinstance(p[0], int):
        prompts = [list(p)]
    else:
        prompts = list(p)
    if not prompts:
        raise APIError(400, "The prompt is empty", "prompt")
    if len(prompts) * n > MAX_SEQS_PER_REQUEST:
        raise APIError(400, f"{len(prompts)} prompts x n={n} is more than {MAX_SEQS_PER_REQUEST} sequences in one "
                       "request; split the request", "prompt")
    tok = state.tokenizer
    if tok is None and any(isinstance(pr, str) for pr in prompts):
        raise APIError(400, "this model has no tokenizer: pass the prompt as token ids", "prompt")
    items: list[tuple[str | None, list[int]]] = await state.off_loop(_encode_prompts, state, prompts)
    max_tokens = req.max_tokens
    for _, ids in items:
        resolve_max_tokens(state, len(ids), max_tokens, "max_tokens")
    skip = True if req.skip_special_tokens is None else req.skip_special_tokens
    params = sampling_params(state, req, max_tokens=max_tokens, logprobs=req.logprobs, skip_special_tokens=skip)
    base = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    gens = [state.engine.generate(f"{base}-{i}", ids, params, prompt=text) for i, (text, ids) in enumerate(items)]
    echo_texts = [(text if text is not None else (tok.decode(ids) if tok is not None else "")) if req.echo else ""
                  for text, ids in items]

    if req.stream:
        return stream_response(_stream(state, req, params, gens, items, echo_texts, base, created))

    finals = await collect_finals(raw, gens)
    if finals is None:
        return Response(status_code=499)
    choices = []
    prompt_tokens = completion_tokens = cached = 0
    for i in range(len(items)):
        out = finals[i]
        prompt_tokens += len(out.prompt_token_ids)
        cached += out.num_cached_tokens
        for o in sorted(out.outputs, key=lambda o: o.index):
            completion_tokens += len(o.token_ids)
            vis = visible_tokens(state, o, params)
            lp = None
            if req.logprobs is not None and o.logprobs is not None:
                lp = completion_logprobs(state, o.token_ids[:vis], o.logprobs[:vis], len(echo_texts[i]),
                                         req.logprobs, bool(req.return_tokens_as_token_ids))
            choices.append({"index": i * n + o.index, "text": echo_texts[i] + o.text, "logprobs": lp,
                            "finish_reason": finish_reason(o.finish_reason), "stop_reason": o.stop_reason})
    return {"id": base, "object": "text_completion", "created": created, "model": req.model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached)}


async def _stream(state: ServerState, req: CompletionRequest, params: SamplingParams, gens, items, echo_texts,
                  base: str, created: int):
    n = params.n
    include_usage, continuous = usage_modes(req)
    holdback = stop_holdback(params)
    trackers = {(i, j): Tracker(holdback, None) for i in range(len(items)) for j in range(n)}
    echoed: set[tuple[int, int]] = set()
    last: dict[int, RequestOutput] = {}

    def chunk(choices):
        body = {"id": base, "object": "text_completion", "created": created, "model": req.model, "choices": choices}
        if continuous:
            body["usage"] = usage_of(last.values())
        return sse(body)

    try:
        async for i, out in merge(gens):
            last[i] = out
            choices = []
            for o in out.outputs:
                key = (i, o.index)
                tr = trackers[key]
                final = o.finish_reason is not None
                offset = len(echo_texts[i]) + tr.sent_text
                text = tr.text_delta(o, final)
                if req.echo and key not in echoed:
                    echoed.add(key)
                    text = echo_texts[i] + text
                ids, lps = tr.token_delta(o, visible_tokens(state, o, params) if final else len(o.token_ids))
                if not text and not final and not ids:
                    continue
                lp = None
                if req.logprobs is not None and lps:
                    lp = completion_logprobs(state, ids, lps, offset, req.logprobs,
                                             bool(req.return_tokens_as_token_ids))
                choices.append({"index": i * n + o.index, "text": text, "logprobs": lp,
                                "finish_reason": finish_reason(o.finish_reason) if final else None,
                                "stop_reason": o.stop_reason if final else None})
            if choices:
                yield chunk(choices)
    except (RequestError, EngineDeadError, RequestFailed) as e:
        yield stream_error_end(e)
        return
    if include_usage:
        yield sse({"id": base, "object": "text_completion", "created": created, "model": req.model,
                   "choices": [], "usage": usage_of(last.values())})
    yield SSE_DONE
