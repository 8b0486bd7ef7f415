"""A sequence: one generated completion, its tokens, its KV blocks and where it is in its life."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from megakernel.engine.sampling_params import SamplingParams
from megakernel.kv.block_manager import SequenceBlocks


class Status(enum.Enum):
    WAITING = "waiting"        # not admitted; holds no KV blocks
    RUNNING = "running"        # admitted; holds blocks for its computed tokens
    FINISHED = "finished"


_ids = itertools.count()


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]      # the top-N alternatives (token id -> logprob), chosen token included if in top


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int                                  # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    blocks: SequenceBlocks
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0                       # tokens whose K/V are in the cache
    num_cached_prompt: int = 0                  # prompt tokens served from the prefix cache (for usage stats)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None       # the stop token id or stop string that ended it
    error: str | None = None                   # why the engine failed it, if it did
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_preemptions: int = 0
    eos_token_ids: tuple[int, ...] = ()        # end the sequence unless params.ignore_eos

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
