"""Logprobs in the two shapes OpenAI uses: /v1/completions' parallel lists and /v1/chat/completions' entries."""

from __future__ import annotations

from typing import Any

from megakernel.server.state import ServerState


def completion_logprobs(state: ServerState, ids: list[int], lps: list, offset: int, n_top: int,
                        as_ids: bool = False) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for tid, lp in zip(ids, lps):
        s = state.token_str(tid, as_ids)
        tokens.append(s)
        token_lps.append(lp.logprob)
        tops.append({state.token_str(t, as_ids): v for t, v in list(lp.top.items())[:n_top]} if n_top else None)
        offsets.append(pos)
        pos += len(state.token_str(tid))
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(state: ServerState, ids: list[int], lps: list, n_top: int, as_ids: bool = False
                  ) -> dict[str, Any]:
    content = []
    for tid, lp in zip(ids, lps):
        s = state.token_str(tid, as_ids)
        tops = [{"token": state.token_str(t, as_ids), "logprob": v, "bytes": list(state.token_str(t).encode())}
                for t, v in list(lp.top.items())[:n_top]]
        content.append({"token": s, "logprob": lp.logprob, "bytes": list(s.encode()), "top_logprobs": tops})
    return {"content": content, "refusal": None}
