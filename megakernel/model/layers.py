"""The math of one Cohere2-MoE layer, written to match transformers' `Cohere2MoeForCausalLM` op for op
(dtype casts included), so fp32 results agree to rounding and bf16 results to bf16 rounding."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megakernel.config import ModelConfig
from megakernel.model.weights import MLPWeights, MoEWeights


def norm(x: torch.Tensor, weight: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    if cfg.norm_type == "rms":
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
        return weight * xf.to(dtype)
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    xf = (xf - mean) * torch.rsqrt(var + cfg.norm_eps)
    return (weight.float() * xf).to(dtype)


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 [head_dim / 2]: the RoPE frequency of each interleaved pair (2i, 2i+1), as transformers computes it.
    Every backend takes its frequencies from here."""
    d = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))


def rope_cos_sin(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin per position, interleaved pairs (2i, 2i+1) share a frequency; rounded to the activation dtype."""
    inv_freq = rope_inv_freq(cfg, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.repeat_interleave(freqs, 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half_interleaved(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([-x2, x1], dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]. Product in fp32, result in x's dtype."""
    xf = x.float()
    c, s = cos[:, None, :], sin[:, None, :]
    return (xf * c + _rotate_half_interleaved(xf) * s).to(x.dtype)


def swiglu(x: torch.Tensor, w: MLPWeights) -> torch.Tensor:
    gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w.down)


def route(x: torch.Tensor, router: torch.Tensor, cfg: ModelConfig, logits_out: list | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token and their weights (in x's dtype), as transformers' Cohere2MoeTopKRouter. The router
    logits are appended to `logits_out` when given (for judging near ties between backends)."""
    logits = F.linear(x, router)
    if logits_out is not None:
        logits_out.append(logits)
    scores, experts = torch.topk(logits, cfg.num_experts_per_tok, dim=-1)
    if cfg.expert_selection_fn == "softmax":
        scores = F.softmax(scores, dim=1, dtype=torch.float)
    else:
        scores = torch.sigmoid(scores)
        if cfg.norm_topk_prob:
            scores = scores / scores.sum(dim=-1, keepdim=True)
    return experts, scores.to(x.dtype)


def moe(x: torch.Tensor, w: MoEWeights, cfg: ModelConfig, trace: list | None = None,
        grouped: bool = False, logits_out: list | None = None) -> torch.Tensor:
    """Routed experts (+ shared). `grouped`: one grouped GEMM per projection over the tokens sorted by expert,
    with no host sync (CUDA); else a loop over the hit experts, the exact path transformers' loop takes."""
    experts, scores = route(x, w.router, cfg, logits_out)
    if trace is not None:
        trace.append(experts)
    out = None
    if grouped and _GROUPED_OK[0]:
        try:
            out = _moe_grouped(x, w, experts, scores)
        except RuntimeError as e:          # a torch build without grouped GEMM for this device: say so once
            _GROUPED_OK[0] = False
            logging.getLogger("megakernel").warning("grouped-GEMM experts unavailable (%s); looping over experts",
                                                    str(e).splitlines()[0])
    if out is None:
        out = _moe_loop(x, w, experts, scores)
    if w.shared is not None:
        shared = swiglu(x, w.shared)
        out = out + shared if cfg.shared_expert_combination == "sum" else (out + shared) / 2
    return out


_GROUPED_OK = [True]


def _moe_loop(x: torch.Tensor, w: MoEWeights, experts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    # Experts in ascending order, tokens accumulated with index_add: the same summation order as transformers.
    hit = torch.unique(experts)
    for e in hit.tolist():
        tok, slot = torch.where(experts == e)
        h = x[tok]
        gate, up = F.linear(h, w.experts_gate_up[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w.experts_down[e])
        h = h * scores[tok, slot, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out


def _moe_grouped(x: torch.Tensor, w: MoEWeights, experts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The same math as `_moe_loop` (per expert: gate/up, SiLU * up, down, times the score, each rounded to the
    activation dtype; summed per token in ascending expert order) with `torch._grouped_mm`: each routed expert's
    weights are read once per call, and nothing waits for the GPU."""
    T, K = experts.shape
    E = w.experts_gate_up.shape[0]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)                    # pairs by expert, then by token
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // K
    h = torch._grouped_mm(x[tok], w.experts_gate_up.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    h = torch._grouped_mm(F.silu(gate) * up, w.experts_down.transpose(1, 2), offs=offs)
    h = h * scores.reshape(-1)[order, None]
    rank = torch.argsort(torch.argsort(experts, dim=1), dim=1).reshape(-1)[order]   # position among the row's experts
    y = torch.empty(T, K, x.shape[1], dtype=x.dtype, device=x.device)
    y[tok, rank] = h.to(x.dtype)
    out = y[:, 0]
    for k in range(1, K):                                       # ascending expert id, each sum rounded: as index_add
        out = out + y[:, k]
    return out


def paged_attention(q: torch.Tensor, q_pos: torch.Tensor, layer_kv: torch.Tensor, table: list[int],
                    window: int | None, block_size: int, scale: float) -> torch.Tensor:
    """Attention of one sequence's queries over its paged keys.

    q: [n, heads, head_dim] at positions q_pos (ascending; the last one is the newest token).
    layer_kv: [num_blocks, 2, block_size, kv_heads, head_dim]; table: the sequence's block table in this group.
    Keys visible to a query at p: positions k <= p with p - k < window. Math as transformers' eager attention.
    """
    n, n_heads, d = q.shape
    n_kv = layer_kv.shape[3]
    g = n_heads // n_kv
    first_q, last_q = int(q_pos[0]), int(q_pos[-1])
    lo = 0 if window is None else max(0, first_q - window + 1)
    b0, b1 = lo // block_size, last_q // block_size + 1
    blocks = torch.tensor(table[b0:b1], device=layer_kv.device, dtype=torch.long)
    kv = layer_kv[blocks]                                              # [nb, 2, bs, n_kv, d]
    k = kv[:, 0].reshape(-1, n_kv, d)
    v = kv[:, 1].reshape(-1, n_kv, d)
    k_pos = torch.arange(b0 * block_size, b1 * block_size, device=q.device)
    keep = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        keep &= (q_pos[:, None] - k_pos[None, :]) < window
    mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, torch.finfo(q.dtype).min)
    # [n_kv, n*g, d]: rows ordered (token, head-in-group) so query head h reads kv head h // g, as repeat_kv.
    qh = q.view(n, n_kv, g, d).permute(1, 0, 2, 3).reshape(n_kv, n * g, d)
    scores = torch.matmul(qh, k.permute(1, 2, 0)) * scale                 # [n_kv, n*g, S]
    scores = scores + mask.repeat_interleave(g, dim=0)[None]
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v.permute(1, 0, 2))                        # [n_kv, n*g, d]
    return out.view(n_kv, n, g, d).permute(1, 0, 2, 3).reshape(n, n_heads * d)


@dataclass
class DecodeAttentionPlan:
    """Where each row's visible keys live, shared by every layer of one KV group (same tables, same window)."""

    blocks: torch.Tensor      # [n, width] block ids to gather (padding points at block 0)
    mask: torch.Tensor        # [n, width * block_size] additive: 0 where visible, dtype min elsewhere


def plan_decode_attention(q_pos: torch.Tensor, tables: list[list[int]], window: int | None, block_size: int,
                          dtype: torch.dtype) -> DecodeAttentionPlan:
    """Row i (one new token of sequence i at q_pos[i], block table tables[i]) sees its visible blocks gathered
    into a padded range; padding and out-of-window keys are masked."""
    pos = q_pos.tolist()
    first = [0 if window is None else max(0, p - window + 1) // block_size for p in pos]
    last = [p // block_size + 1 for p in pos]
    width = max(b - a for a, b in zip(first, last))
    idx = torch.zeros(len(pos), width, dtype=torch.long)
    for i, (a, b) in enumerate(zip(first, last)):
        idx[i, : b - a] = torch.tensor(tables[i][a:b])
    dev = q_pos.device
    k_pos = torch.tensor(first, device=dev)[:, None] * block_size + torch.arange(width * block_size, device=dev)
    keep = (k_pos <= q_pos[:, None]) & (k_pos < torch.tensor(last, device=dev)[:, None] * block_size)
    if window is not None:
        keep &= (q_pos[:, None] - k_pos) < window
    mask = torch.zeros(keep.shape, dtype=dtype, device=dev).masked_fill_(~keep, torch.finfo(dtype).min)
    return DecodeAttentionPlan(idx.to(dev), mask)


def paged_decode_attention(q: torch.Tensor, layer_kv: torch.Tensor, plan: DecodeAttentionPlan,
                           scale: float) -> torch.Tensor:
    """Attention of one new token per sequence, for many sequences at once (same math as `paged_attention`).

    q: [n, heads, head_dim]; `plan` says which blocks each row sees.
    """
    n, n_heads, d = q.shape
    n_kv, block_size = layer_kv.shape[3], layer_kv.shape[2]
    g = n_heads // n_kv
    width = plan.blocks.shape[1]
    kv = layer_kv[plan.blocks]                                        # [n, width, 2, bs, n_kv, d]
    k = kv[:, :, 0].reshape(n, width * block_size, n_kv, d)
    v = kv[:, :, 1].reshape(n, width * block_size, n_kv, d)
    qh = q.view(n, n_kv, g, d)
    scores = torch.matmul(qh, k.permute(0, 2, 3, 1)) * scale        # [n, n_kv, g, S]
    scores = scores + plan.mask[:, None, None, :]
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3))                  # [n, n_kv, g, d]
    return out.reshape(n, n_heads * d)
