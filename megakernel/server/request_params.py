"""From a validated request body to what the engine takes: the model name checked, sampling parameters, prompt
token ids checked against the vocabulary and the context length, max_tokens resolved."""

from __future__ import annotations

from megakernel.engine.sampling_params import SamplingParams
from megakernel.errors import RequestError
from megakernel.server.errors import APIError
from megakernel.server.protocol import MAX_N, malformed_text
from megakernel.server.state import ServerState

SEED_MOD = 2**63 - MAX_N - 1      # seeds are reduced into range; each of the n completions adds its index


def check_model(state: ServerState, req) -> None:
    bad = malformed_text(req)
    if bad is not None:
        raise APIError(400, f"Invalid text in '{bad}': it is not valid Unicode (a lone UTF-16 surrogate?)", bad)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    model = req.model
    if model not in state.cfg.served_model_names:
        raise APIError(404, f"The model `{model}` does not exist. Served: {', '.join(state.cfg.served_model_names)}",
                       "model", "model_not_found")


def sampling_params(state: ServerState, req, *, max_tokens: int | None, logprobs: int | None,
                    skip_special_tokens: bool) -> SamplingParams:
    bias: dict[int, float] = {}
    for k, v in (req.logit_bias or {}).items():
        try:
            tid = int(k)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
        if not 0 <= tid < state.vocab_size:
            raise APIError(400, f"logit_bias token id {tid} is outside the vocabulary (size {state.vocab_size})",
                           "logit_bias")
        if not -100 <= v <= 100:
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {v}", "logit_bias")
        bias[tid] = float(v)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "stop strings must not be empty", "stop")
    if stop and state.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so stop strings cannot be matched; use stop_token_ids",
                       "stop")
    stop_ids = list(req.stop_token_ids or [])
    bad = [t for t in stop_ids if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids: token id {bad[0]} is outside the vocabulary", "stop_token_ids")
    seed = None if req.seed is None else req.seed % SEED_MOD
    try:
        return SamplingParams(
            n=req.n or 1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0,
            seed=seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens or 0,
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=bool(req.ignore_eos),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias,
            logprobs=logprobs,
            skip_special_tokens=skip_special_tokens,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
        )
    except RequestError as e:
        raise APIError(400, str(e), str(e).split(" ", 1)[0]) from None


def stop_holdback(params: SamplingParams) -> int:
    """Characters a stream holds back so it never sends the start of a stop string that is cut off later."""
    return max((len(s) for s in params.stop), default=1) - 1 if not params.include_stop_str_in_output else 0


def check_prompt_ids(state: ServerState, ids: list[int], param: str) -> None:
    if not ids:
        raise APIError(400, "The prompt is empty", param)
    if len(ids) >= state.max_model_len:       # (text prompts are cut at max_model_len tokens)
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, your "
                       f"prompt has {len(ids) if len(ids) > state.max_model_len else 'at least ' + str(len(ids))} "
                       f"tokens (at least one token must be left for the completion). Please reduce the length of "
                       f"the prompt.", param, "context_length_exceeded")
    bad = next((t for t in ids if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"prompt token id {bad} is outside the vocabulary (size {state.vocab_size})", param)


def resolve_max_tokens(state: ServerState, n_prompt: int, max_tokens: int | None, param: str) -> int:
    room = state.max_model_len - n_prompt
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, you "
                       f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the "
                       f"completion). Please reduce the prompt or the completion length.", param,
                       "context_length_exceeded")
    return max_tokens


# Tokens the end of a cut-off prefix may have that the whole text does not: the cut can split a word (or a run of
# spaces) whose pieces tokenise into more tokens than the whole; a few tokens in practice, 64 is far beyond any.
CUT_SLACK_TOKENS = 64
FIRST_CUT_CHARS_PER_TOKEN = 8     # the first prefix holds 8 characters per allowed token (English averages ~4)


def encode(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of text (on a prep thread), cut at max_model_len: a longer prompt is refused anyway."""
    return encode_capped(state.worker_tokenizer, text, add_special_tokens, state.max_model_len)


def encode_capped(tokenizer, text: str, add_special_tokens: bool, cap: int) -> list[int]:
    """The text's token ids when it has fewer than `cap` tokens, else its first `cap` ids.

    Why not one call with truncation: the Rust tokenizer still tokenises the whole text, and handing back and freeing
    an encoding of millions of tokens holds the GIL for 50 ms on a quiet machine and several times that on a busy one,
    stalling the event loop (and /health) behind an 8 MB prompt. So only a prefix is tokenised, at first 8 characters
    per allowed token, growing 4x while it yields too few tokens: the work is bounded by the cap, not the text.
    A prefix that already has `cap + CUT_SLACK_TOKENS` tokens settles it: extending a text only re-tokenises its
    last few tokens, so the whole text has at least `cap`, and its first `cap` ids are the prefix's.
    """
    if not text:
        return []
    chars = max(cap * FIRST_CUT_CHARS_PER_TOKEN, 4096)
    while True:
        whole = len(text) <= chars
        ids = tokenizer.encode(text if whole else text[:chars], add_special_tokens=add_special_tokens,
                               truncation=True, max_length=cap + CUT_SLACK_TOKENS)
        if whole or len(ids) >= cap + CUT_SLACK_TOKENS:
            return ids[:cap]
        chars *= 4
