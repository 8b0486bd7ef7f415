"""Token choice from logits: penalties, logit bias, temperature, top-k, top-p, min-p, seeded sampling, logprobs.

Vectorised over the batch. Seeded rows draw their noise from their own generator, so a seed gives the same
tokens whether the request runs alone or in a busy batch.
"""

from __future__ import annotations

import torch

from megakernel.engine.sequence import Sequence, TokenLogprob


def _penalise(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.needs_penalties:
            out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
                vals = logits[row, seen]
                logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if out.numel() and (p.presence_penalty or p.frequency_penalty):
                counts = torch.bincount(out, minlength=logits.shape[1]).to(logits.dtype)
                logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            logits[row, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if p.min_tokens and len(seq.output_token_ids) < p.min_tokens:
            ban = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids))
            if ban:
                logits[row, torch.tensor(sorted(ban), device=logits.device)] = float("-inf")


def sample(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator | None = None
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """Choose one token per row of fp32 `logits` [B, V] for `seqs`. Returns token ids and logprob records."""
    B, V = logits.shape
    want_logprobs = [s.params.logprobs for s in seqs]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in want_logprobs) else None

    params = [s.params for s in seqs]
    if any(p.needs_penalties or p.logit_bias or p.min_tokens for p in params):
        logits = logits.clone()
        _penalise(logits, seqs)

    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    chosen = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        dev = logits.device
        temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)[:, None]
        scaled = logits / temp
        top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        if bool((top_k < V).any()) or bool((top_p < 1).any()):
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
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        # Exponential-race sampling (argmax p/q, q ~ Exp(1)) equals sampling from p; each row's noise comes
        # from its own generator when seeded.
        noise = torch.empty_like(probs)
        for row, seq in enumerate(seqs):
            noise[row].exponential_(generator=seq.generator or default_generator)
        sampled = (probs / noise).argmax(dim=-1)
        chosen = torch.where(greedy, chosen, sampled)

    tokens = chosen.tolist()
    records: list[TokenLogprob | None] = []
    for row, n in enumerate(want_logprobs):
        if n is None:
            records.append(None)
            continue
        lp = raw_logprobs[row]
        top = {}
        if n > 0:
            vals, idx = lp.topk(n)
            top = dict(zip(idx.tolist(), vals.tolist()))
        records.append(TokenLogprob(tokens[row], float(lp[tokens[row]]), top))
    return tokens, records
