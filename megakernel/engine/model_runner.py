"""Turns scheduled chunks into model forwards on the chosen backend and returns logits to sample from."""

from __future__ import annotations

import logging

import torch

from megakernel.engine.scheduler import ScheduledChunk
from megakernel.kv.cache import KVCache
from megakernel.model.cohere2_moe import Cohere2MoeModel, ForwardBatch, ForwardTrace

log = logging.getLogger("megakernel")


def build_batch(chunks: list[ScheduledChunk], device: torch.device) -> ForwardBatch:
    ids: list[int] = []
    pos: list[int] = []
    starts = [0]
    rows: list[int] = []
    for c in chunks:
        ids.extend(c.seq.token_ids[c.start:c.end])
        pos.extend(range(c.start, c.end))
        starts.append(len(ids))
        if c.samples:
            rows.append(len(ids) - 1)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        starts=starts,
        block_tables=[c.seq.blocks.tables for c in chunks],
        logits_rows=torch.tensor(rows, dtype=torch.long, device=device),
    )


class ModelRunner:
    """Runs prefill chunks on the PyTorch path and decode steps on the decode backend (megakernel or PyTorch)."""

    def __init__(self, model: Cohere2MoeModel, cache: KVCache, decode_backend=None) -> None:
        self.model = model
        self.cache = cache
        self.decode_backend = decode_backend
        self.trace: ForwardTrace | None = None     # set to record the experts each step routes to (benchmarks)

    @property
    def backend_name(self) -> str:
        return "megakernel" if self.decode_backend is not None else "torch"

    def run(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Execute one step. Returns the chunks that produce a token and their fp32 logits, in that order."""
        decodes = [c for c in chunks if c.is_decode] if self.decode_backend is not None else []
        others = [c for c in chunks if not (self.decode_backend is not None and c.is_decode)]
        sampled: list[ScheduledChunk] = []
        logits: list[torch.Tensor] = []
        if others:
            batch = build_batch(others, self.model.device)
            out = self.model.forward(batch, self.cache, self.trace)
            sampled += [c for c in others if c.samples]
            logits.append(out)
        if decodes:
            batch = build_batch(decodes, self.model.device)
            logits.append(self.decode_backend.decode(batch, self.cache, trace=self.trace))
            sampled += decodes
        if not logits:
            return [], torch.empty(0)
        return sampled, torch.cat(logits) if len(logits) > 1 else logits[0]
