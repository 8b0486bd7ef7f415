"""Pieces of response bodies both endpoints share: which tokens a choice shows, its finish reason, usage."""

from __future__ import annotations

from typing import Any, Iterable

from megakernel.engine.outputs import CompletionOutput, RequestOutput
from megakernel.engine.sampling_params import SamplingParams
from megakernel.server.state import ServerState


def visible_tokens(state: ServerState, o: CompletionOutput, params: SamplingParams) -> int:
    """How many of o's tokens belong to the answer (a final EOS or stop token is not shown)."""
    n = len(o.token_ids)
    if n and o.finish_reason == "stop" and (o.stop_reason is None or isinstance(o.stop_reason, int)) and \
            (o.token_ids[-1] in state.eos_ids or o.token_ids[-1] in params.stop_token_ids):
        return n - 1
    return n


def finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason as OpenAI names it (an aborted sequence shows as "stop")."""
    return "stop" if reason == "abort" else reason


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def usage_of(outs: Iterable[RequestOutput]) -> dict[str, Any]:
    """Usage so far of a stream's requests (their newest snapshots)."""
    outs = list(outs)
    return usage(sum(len(o.prompt_token_ids) for o in outs), sum(len(c.token_ids) for o in outs for c in o.outputs),
                 sum(o.num_cached_tokens for o in outs))


def usage_modes(req) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage in every chunk) as stream_options asks."""
    so = req.stream_options
    return bool(so and so.include_usage), bool(so and so.continuous_usage_stats)
