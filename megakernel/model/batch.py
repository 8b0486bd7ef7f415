"""What the engine hands a model forward or a decode backend, and what a backend may record: the seam types
between the engine and every backend (PyTorch path, megakernel, CUDA graphs), apart from any one of them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megakernel.transfer import to_device


@dataclass
class ForwardBatch:
    """A ragged batch: sequence i contributes tokens flat[starts[i]:starts[i+1]] at consecutive positions."""

    input_ids: torch.Tensor            # [T] long
    positions: torch.Tensor            # [T] long
    starts: list[int]                  # len B+1, offsets into the flat token axis
    block_tables: list[list[list[int]]]  # [seq][group] -> block ids (FREED for recycled sliding blocks)
    logits_rows: torch.Tensor | None = None   # flat rows to produce logits for; None = last token of each seq
    positions_list: list[int] | None = None   # `positions` on the host, when the caller has it (saves a sync)

    @property
    def num_seqs(self) -> int:
        return len(self.starts) - 1

    def last_rows(self) -> torch.Tensor:
        return to_device([s - 1 for s in self.starts[1:]], torch.long, self.input_ids.device)

    def host_positions(self) -> list[int]:
        return self.positions_list if self.positions_list is not None else self.positions.tolist()


@dataclass
class ForwardTrace:
    """Optional record of internals, for comparing backends: the chosen experts per MoE layer and, when `hidden`
    is a list, the residual stream after the embedding and after every layer; when `router_logits` is a list, each
    MoE layer's router logits (the PyTorch path and the graph backend's uncaptured step record them; the megakernel's
    tests read its scratch)."""

    experts: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] | None = None
    router_logits: list[torch.Tensor] | None = None
