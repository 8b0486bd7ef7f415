"""Token choice from logits: penalties, logit bias, temperature, top-k, top-p, min-p, seeded sampling, logprobs.

Vectorised over the batch. Seeded rows draw their noise from their own generator, so a seed gives the same
tokens whether the request runs alone or in a busy batch.

`sample_async` only enqueues device work and returns device tensors (`SampledTokens`); the host reads them with
`resolve()` one step later, after it has launched the next step. Every decision about *which* ops to run is
taken from the requests' parameters on the host, never from device values, so nothing here waits for the GPU.
A row's history may end in a token still in flight (`Sequence.pending`): penalties read it on the device.

Rows of constrained sequences (`Sequence.matcher`, see engine/grammar.py) get their grammar's token mask, built on
the host from the matcher (which has consumed every token of the sequence: the scheduler never runs a constrained
sequence with a token in flight) and uploaded without a sync. Batches without such rows skip this entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megakernel.engine.sequence import Sequence, TokenLogprob
from megakernel.transfer import to_device


def _ids_on_device(seq: Sequence, start: int, end: int, device: torch.device) -> torch.Tensor:
    """seq's tokens at positions [start, end) on the device, tokens still in flight copied from the device
    tensors of the step that sampled them."""
    t = to_device(seq.token_ids[start:end], torch.long, device)
    for j, src, row in seq.in_flight(start, end):
        t[j - start] = src[row]
    return t


def _penalise(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    dev, V = logits.device, logits.shape[1]
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.needs_penalties:
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(V, dtype=torch.bool, device=dev)
                seen.index_fill_(0, _ids_on_device(seq, 0, len(seq), dev), True)    # no host sync
                vals = logits[row]
                logits[row] = torch.where(seen, torch.where(vals > 0, vals / p.repetition_penalty,
                                                            vals * p.repetition_penalty), vals)
            if seq.num_output and (p.presence_penalty or p.frequency_penalty):
                out = _ids_on_device(seq, seq.num_prompt, len(seq), dev)
                counts = torch.zeros(V, dtype=logits.dtype, device=dev)
                counts.scatter_add_(0, out, torch.ones(out.shape, dtype=logits.dtype, device=dev))
                logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.logit_bias:
            ids = to_device(list(p.logit_bias), torch.long, dev)
            logits[row, ids] += to_device(list(p.logit_bias.values()), logits.dtype, dev)
        if p.min_tokens and seq.num_output < p.min_tokens:
            ban = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids))
            if ban:
                logits[row].index_fill_(0, to_device(sorted(ban), torch.long, dev), float("-inf"))


def _mask_grammar(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Set the logits of tokens the grammar forbids to -inf, in the rows of constrained sequences only."""
    rows = [row for row, seq in enumerate(seqs) if seq.matcher is not None]
    dev, V = logits.device, logits.shape[1]
    words = torch.from_numpy(np.stack([seqs[row].matcher.bitmask() for row in rows]))     # [k, W] int32
    words = to_device(words, torch.int32, dev)
    bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32, device=dev)) & 1
    allowed = bits.reshape(len(rows), -1).bool()
    if allowed.shape[1] < V:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    idx = to_device(rows, torch.long, dev)
    logits[idx] = logits[idx].masked_fill(~allowed[:, :V], float("-inf"))


@dataclass
class SampledTokens:
    """One sampling call's results: device tensors, and (on a GPU) their host copies in flight."""

    tokens: torch.Tensor                       # [B] long
    want_logprobs: list[int | None]            # per row: None, or how many top alternatives
    chosen_logprob: torch.Tensor | None        # [B] fp32
    top_ids: torch.Tensor | None               # [B, max n]
    top_vals: torch.Tensor | None
    _host: list[torch.Tensor | None] | None = None
    _ready: torch.cuda.Event | None = None

    def start_readback(self) -> None:
        """Enqueue the copies to pinned host memory now. Reading the device tensors later with `.tolist()`
        would synchronise the whole stream, that is also wait for the step launched after this one."""
        parts = [self.tokens, self.chosen_logprob, self.top_ids, self.top_vals]
        if self.tokens.device.type != "cuda":
            self._host = parts
            return
        self._host = []
        for t in parts:
            if t is None:
                self._host.append(None)
                continue
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            self._host.append(h)
        self._ready = torch.cuda.Event()
        self._ready.record(torch.cuda.current_stream(self.tokens.device))

    def resolve(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """Read the tokens (and logprobs) back to the host: the one wait for the GPU per step, and only up to
        this sampling call (not for later work on the stream)."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens_t, chosen_t, ids_t, vals_t = self._host
        tokens = tokens_t.tolist()
        records: list[TokenLogprob | None] = []
        if chosen_t is None:
            return tokens, [None] * len(tokens)
        chosen = chosen_t.tolist()
        ids = ids_t.tolist() if ids_t is not None else None
        vals = vals_t.tolist() if vals_t is not None else None
        for row, n in enumerate(self.want_logprobs):
            if n is None:
                records.append(None)
                continue
            top = dict(zip(ids[row][:n], vals[row][:n])) if n > 0 else {}
            records.append(TokenLogprob(tokens[row], chosen[row], top))
        return tokens, records


def sample_async(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator | None = None
                 ) -> SampledTokens:
    """Choose one token per row of fp32 `logits` [B, V] for `seqs`, enqueueing device work only."""
    B, V = logits.shape
    dev = logits.device
    params = [s.params for s in seqs]
    want = [p.logprobs for p in params]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in want) else None

    constrained = any(seq.matcher is not None for seq in seqs)
    if constrained or any(p.needs_penalties or p.logit_bias or p.min_tokens for p in params):
        logits = logits.clone()
        _penalise(logits, seqs)
        if constrained:
            _mask_grammar(logits, seqs)

    chosen = logits.argmax(dim=-1)
    if not all(p.greedy for p in params):
        temp = to_device([1.0 if p.greedy else p.temperature for p in params], logits.dtype, dev)[:, None]
        scaled = logits / temp
        k_host = [p.top_k if p.top_k > 0 else V for p in params]
        if any(k < V for k in k_host) or any(p.top_p < 1 for p in params):
            top_k = to_device(k_host, torch.long, dev)
            top_p = to_device([p.top_p for p in params], logits.dtype, dev)
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            ranks = torch.arange(V, device=dev)[None, :]
            drop = ranks >= top_k[:, None]
            probs_sorted = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            # keep the smallest prefix whose mass reaches top_p (the token crossing the threshold is kept)
            mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
            drop |= mass_before >= top_p[:, None]
            drop[:, 0] = False
            scaled = scaled.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = torch.softmax(scaled, dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = to_device([p.min_p for p in params], logits.dtype, dev)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        # Exponential-race sampling (argmax p/q, q ~ Exp(1)) equals sampling from p; each row's noise comes
        # from its own generator when seeded.
        noise = torch.empty_like(probs)
        shared = [row for row, seq in enumerate(seqs) if seq.generator is None]
        if len(shared) == B:
            noise.exponential_(generator=default_generator)
        else:
            for row, seq in enumerate(seqs):
                if seq.generator is not None:
                    noise[row].exponential_(generator=seq.generator)
            if shared:
                idx = to_device(shared, torch.long, dev)
                noise[idx] = torch.empty(len(shared), V, dtype=probs.dtype, device=dev).exponential_(
                    generator=default_generator)
        sampled = (probs / noise).argmax(dim=-1)
        greedy = to_device([p.greedy for p in params], torch.bool, dev)
        chosen = torch.where(greedy, chosen, sampled)

    chosen_lp = top_ids = top_vals = None
    if raw_logprobs is not None:
        chosen_lp = raw_logprobs.gather(1, chosen[:, None])[:, 0]
        n_max = max((n for n in want if n), default=0)
        if n_max > 0:
            top_vals, top_ids = raw_logprobs.topk(n_max, dim=-1)
    out = SampledTokens(chosen, want, chosen_lp, top_ids, top_vals)
    out.start_readback()
    return out


def sample(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator | None = None
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """Choose one token per row and read it back at once (token ids and logprob records)."""
    return sample_async(logits, seqs, default_generator).resolve()
