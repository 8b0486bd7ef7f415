"""What generation returns: per request, one CompletionOutput per sampled completion (n of them).

A request still running is reported every step; its token ids and logprobs are then read-only views of what the
engine holds (`ListView`: indexable, sliceable, equal to a list with the same items), so a step costs O(new
tokens), not a copy of the whole output. Once finished they are plain lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from megakernel.engine.sequence import TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    token_ids: Sequence[int]
    text: str
    finish_reason: str | None            # "stop", "length", "abort", or None while running
    logprobs: Sequence[TokenLogprob] | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it, if any
    reasoning: str | None = None          # LLM.chat(): the reasoning, apart from the answer in `text`

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None              # set when the engine failed the request (e.g. a hung decode step)

    # Conveniences for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> Sequence[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
