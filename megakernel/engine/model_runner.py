"""Turns scheduled chunks into model forwards on the chosen backend and returns logits to sample from."""

from __future__ import annotations

import logging

import torch

from megakernel.engine.scheduler import ScheduledChunk
from megakernel.transfer import to_device
from megakernel.kv.cache import KVCache
from megakernel.model.batch import ForwardBatch, ForwardTrace
from megakernel.model.cohere2_moe import Cohere2MoeModel
from megakernel.model.decode_backend import Check, DecodeBackend

log = logging.getLogger("megakernel")


def build_batch(chunks: list[ScheduledChunk], device: torch.device) -> ForwardBatch:
    """The ragged batch of `chunks`, uploaded without waiting for the GPU. A decode's input token may still be in
    flight (sampled by the previous step, not read back): it is copied from that step's device tensor."""
    ids: list[int] = []
    pos: list[int] = []
    starts = [0]
    rows: list[int] = []
    in_flight: list[tuple[int, torch.Tensor, int]] = []      # (flat row, device tokens, their row)
    for c in chunks:
        base = len(ids) - c.start
        ids.extend(c.seq.token_ids[c.start:c.end])           # a placeholder is overwritten on the device below
        in_flight += [(base + j, src, row) for j, src, row in c.seq.in_flight(c.start, c.end)]
        pos.extend(range(c.start, c.end))
        starts.append(len(ids))
        if c.samples:
            rows.append(len(ids) - 1)
    input_ids = to_device(ids, torch.long, device)
    for row, src, src_row in in_flight:
        input_ids[row] = src[src_row]
    return ForwardBatch(
        input_ids=input_ids,
        positions=to_device(pos, torch.long, device),
        starts=starts,
        block_tables=[c.seq.blocks.tables for c in chunks],
        logits_rows=None if rows == [s - 1 for s in starts[1:]] else to_device(rows, torch.long, device),
        positions_list=pos,
    )


class ModelRunner:
    """Runs prefill chunks on the PyTorch path and decode rows on the decode backend (megakernel, CUDA graphs or
    the PyTorch path itself)."""

    def __init__(self, model: Cohere2MoeModel, cache: KVCache, decode_backend: DecodeBackend) -> None:
        self.model = model
        self.cache = cache
        self.decode_backend = decode_backend      # TorchDecodeBackend(model): decodes run with the prefill
        self.trace: ForwardTrace | None = None     # set to record the experts each step routes to (benchmarks)

    @property
    def backend_name(self) -> str:
        return self.decode_backend.name

    def run(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], torch.Tensor, list[Check]]:
        """Launch one step. Returns the chunks that produce a token, their fp32 logits (in that order, possibly
        still being computed) and the checks to call before trusting them: each waits for the decode backend's
        launch to finish and raises MegakernelError if it failed or hung."""
        be = self.decode_backend
        separate = not be.runs_with_prefill
        decodes = [c for c in chunks if separate and c.is_decode]
        others = [c for c in chunks if not (separate and c.is_decode)]
        checks: list[Check] = []
        dec_logits = oth_logits = None
        # Decodes first: the decode backend runs on the GPU while the host is still issuing the PyTorch prefill
        # (which waits for device values inside its MoE dispatch).
        if decodes:
            dec_logits, check = be.decode_async(build_batch(decodes, self.model.device), self.cache, trace=self.trace)
            checks.append(check)
        if others:
            batch = build_batch(others, self.model.device)
            oth_logits = self.model.forward(batch, self.cache, self.trace)
        sampled = [c for c in others if c.samples] + decodes
        logits = [x for x in (oth_logits, dec_logits) if x is not None]
        if not logits:
            return [], torch.empty(0), checks
        return sampled, torch.cat(logits) if len(logits) > 1 else logits[0], checks
