"""A sequence: one generated completion, its tokens, its KV blocks and where it is in its life."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from megakernel.engine.detokenizer import DetokState
from megakernel.engine.list_view import ListView
from megakernel.engine.sampling_params import SamplingParams
from megakernel.kv.block_manager import SequenceBlocks


class Status(enum.Enum):
    WAITING = "waiting"        # not admitted; holds no KV blocks
    RUNNING = "running"        # admitted; holds blocks for its computed tokens
    FINISHED = "finished"


_ids = itertools.count()

PLACEHOLDER = -1     # an output token sampled on the device whose value the host has not read yet


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]      # the top-N alternatives (token id -> logprob), chosen token included if in top


@dataclass(eq=False)
class Sequence:
    """Its tokens live in one list, `token_ids` (prompt then output), which only grows at the end or loses tokens
    still in flight: every per-step read is a slice of what is new, never a copy of the whole context. Output
    tokens change only through `append_output`, `set_output` and `truncate_output`."""

    request_id: str
    index: int                                  # which of the request's n completions
    prompt_token_ids: list[int]                 # never modified (shared with the request)
    params: SamplingParams
    blocks: SequenceBlocks
    num_computed: int = 0                       # tokens whose K/V are in the cache
    num_cached_prompt: int = 0                  # prompt tokens served from the prefix cache (for usage stats)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None       # the stop token id or stop string that ended it
    error: str | None = None                   # why the engine failed it, if it did
    text: str = ""
    detok: DetokState = field(default_factory=DetokState)   # incremental detokenization of the output
    logprobs: list[TokenLogprob] = field(default_factory=list)
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_preemptions: int = 0
    eos_token_ids: tuple[int, ...] = ()        # end the sequence unless params.ignore_eos
    # Output tokens sampled by a launched step but not yet read back: output index -> (device tokens, row).
    # They sit in output_token_ids as PLACEHOLDER, always as the trailing entries.
    pending: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    awaiting_last: bool = False                 # its pending token is its last (max_tokens / max_model_len)
    kv_capped: bool = False                     # the KV pool cannot hold one more token of it, even alone
    matcher: Any = None                         # engine.grammar.GrammarMatcher of a constrained sequence
    token_ids: list[int] = field(init=False, repr=False)    # prompt + output, one list

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> ListView[int]:
        """The output tokens (placeholders included), a read-only view that grows with the sequence."""
        return ListView(self.token_ids, len(self.prompt_token_ids))

    def append_output(self, token: int) -> int:
        """Append an output token (or PLACEHOLDER); returns its output index."""
        self.token_ids.append(token)
        return self.num_output - 1

    def set_output(self, index: int, token: int) -> None:
        self.token_ids[len(self.prompt_token_ids) + index] = token

    def truncate_output(self, n: int) -> None:
        """Keep the first n output tokens."""
        del self.token_ids[len(self.prompt_token_ids) + n:]

    @property
    def num_resolved(self) -> int:
        """Output tokens whose values the host knows."""
        return self.num_output - len(self.pending)

    @property
    def num_known(self) -> int:
        """Tokens (prompt and output) whose values the host knows: a token in flight is a placeholder."""
        return len(self.token_ids) - len(self.pending)

    def in_flight(self, start: int, end: int) -> list[tuple[int, torch.Tensor, int]]:
        """Token positions in [start, end) whose values are still on the device: (position, tokens, row)."""
        n = len(self.prompt_token_ids)
        return [(n + i, src, row) for i, (src, row) in self.pending.items() if start <= n + i < end]

    def drop_pending(self) -> None:
        """Forget tokens still in flight (the sequence ended before they were read back)."""
        if self.pending:
            self.truncate_output(self.num_resolved)
            self.pending.clear()
        self.num_computed = min(self.num_computed, len(self))
        self.awaiting_last = False

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
