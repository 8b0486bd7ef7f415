"""The interface every decode backend implements (PyTorch path, megakernel, CUDA graphs), so the engine's runner
talks to one typed seam instead of special-casing each backend."""

from __future__ import annotations

from typing import Callable

import torch

from megakernel.kv.cache import KVCache
from megakernel.model.batch import ForwardBatch, ForwardTrace
from megakernel.model.cohere2_moe import Cohere2MoeModel

Check = Callable[[], None]


def no_check() -> None:
    """The completion check of a backend that reports failures by raising at launch."""


class DecodeBackend:
    """Runs decode steps: one new token per sequence of a `ForwardBatch`, K/V written into the paged cache.

    `decode_async` enqueues the step and returns fp32 logits [rows, vocab] (valid in stream order) and a check
    that waits for the launch and raises `MegakernelError` if it failed or hung. It must not wait for the GPU.
    A backend takes any number of rows (it splits them into launches of the sizes it supports itself).

    Its capabilities are class attributes the runner reads: `name` (logs, benchmarks) and `runs_with_prefill`.
    Test hooks (a poisoned scratch, an injected hang) are not part of this interface: the tests wrap a backend's
    private steps themselves (tests/kernel_helpers.py).
    """

    name: str = "?"
    runs_with_prefill: bool = False     # True: the runner hands it whole steps, decode rows and prefill chunks

    def decode_async(self, batch: ForwardBatch, cache: KVCache, trace: ForwardTrace | None = None
                     ) -> tuple[torch.Tensor, Check]:
        raise NotImplementedError

    def decode(self, batch: ForwardBatch, cache: KVCache, trace: ForwardTrace | None = None) -> torch.Tensor:
        """One decode step; returns the logits once the step has finished (raises on failure or hang)."""
        logits, check = self.decode_async(batch, cache, trace)
        check()
        return logits


class TorchDecodeBackend(DecodeBackend):
    """The PyTorch path: decode rows run in the same forward as the step's prefill chunks."""

    name = "torch"
    runs_with_prefill = True

    def __init__(self, model: Cohere2MoeModel) -> None:
        self.model = model

    def decode_async(self, batch: ForwardBatch, cache: KVCache, trace: ForwardTrace | None = None
                     ) -> tuple[torch.Tensor, Check]:
        return self.model.forward(batch, cache, trace), no_check
