"""The PyTorch forward of Cohere2-MoE over the paged KV cache: chunked prefill and decode of a ragged batch.

This is the engine's reference path (CPU and GPU) and the oracle the decode megakernel is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megakernel.config import ModelConfig
from megakernel.transfer import to_device
from megakernel.kv.cache import KVCache
from megakernel.model import layers as L
from megakernel.model.batch import ForwardBatch, ForwardTrace  # noqa: F401 (both re-exported: their home is batch.py)
from megakernel.model.weights import LayerWeights, ModelWeights


@dataclass
class LayerContext:
    """Per-forward state shared by all layers (built once by `Cohere2MoeModel.prepare`)."""

    batch: ForwardBatch
    block_size: int
    cos: torch.Tensor
    sin: torch.Tensor
    slots: list[tuple[torch.Tensor, torch.Tensor]]   # per KV group: (block id, offset) of every token
    single: list[int]                  # sequences decoding exactly one token
    multi: list[int]                   # sequences with a chunk of several tokens
    single_rows: torch.Tensor          # flat rows of the single-token sequences
    plans: dict                        # per KV group: decode / prefill attention plans, built by the first layer


# Default prefill tokens per step with the fast path, alone and beside decode rows (measured on the H200 in
# benchmarks/results/prefill_20261201: 8192 tokens prefill 31K tok/s at 8 x 2K but hold streams ~0.6 s per step)
FAST_PREFILL_CHUNK = 8192
FAST_PREFILL_WITH_DECODES = 2048


def prefill_reserve_bytes(cfg: ModelConfig, chunk: int, max_model_len: int, fast: bool) -> int:
    """GPU memory one forward of a `chunk`-token prefill needs beside the weights and the KV cache (an upper
    bound of one layer's live activations: residual, QKV, attention, the routed experts' sorted copies). The exact
    path also materialises fp32 attention scores [heads, chunk, keys]."""
    H, Q, KV, K = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.num_experts_per_tok
    I = max(cfg.moe_intermediate_size, 1)
    per_token = (8 * H + 4 * Q + 4 * KV + cfg.num_experts) * 2 + K * (3 * H + 4 * I) * 2 * 2 \
        + 2 * cfg.dense_intermediate_size * 2 * 2
    scores = 0 if fast else cfg.num_heads * chunk * max_model_len * (4 + 4 + 2)
    return chunk * per_token + scores + (256 << 20)


def fast_prefill_available(weights: ModelWeights) -> bool:
    """Library-speed prefill (Triton flash attention over the paged cache, grouped-GEMM experts): bf16 on CUDA."""
    if weights.device.type != "cuda" or weights.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class Cohere2MoeModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, fast_prefill: bool | None = None) -> None:
        """`fast_prefill` (default: when available) runs chunks of several tokens through the Triton paged flash
        attention and grouped-GEMM experts; otherwise (and always on CPU) the exact path, the transformers
        oracle's own op order."""
        self.cfg = cfg
        self.w = weights
        self.scale = cfg.head_dim ** -0.5
        self.fast_prefill = fast_prefill_available(weights) if fast_prefill is None else fast_prefill

    @property
    def device(self) -> torch.device:
        return self.w.device

    @property
    def dtype(self) -> torch.dtype:
        return self.w.dtype

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, trace: ForwardTrace | None = None) -> torch.Tensor:
        """Run every layer for the batch's tokens, writing their K/V into `cache`; return fp32 logits."""
        h = F.embedding(batch.input_ids, self.w.embed)
        hidden = trace.hidden if trace is not None else None
        if hidden is not None:
            hidden.append(h)
        ctx = self.prepare(batch, cache, h.dtype)
        for i in range(self.cfg.num_layers):
            h = self.layer(i, h, ctx, cache.layer(i), trace)
            if hidden is not None:
                hidden.append(h)
        rows = batch.logits_rows if batch.logits_rows is not None else batch.last_rows()
        return self.logits(h[rows])

    def prepare(self, batch: ForwardBatch, cache: KVCache, dtype: torch.dtype) -> "LayerContext":
        """What every layer of one forward shares: RoPE tables, KV slots, which sequences decode one token."""
        cos, sin = L.rope_cos_sin(batch.positions, self.cfg, dtype)
        lengths = [batch.starts[s + 1] - batch.starts[s] for s in range(batch.num_seqs)]
        single = [s for s, n in enumerate(lengths) if n == 1]
        single_rows = to_device([batch.starts[s] for s in single], torch.long, batch.input_ids.device)
        return LayerContext(batch, cache.layout.block_size, cos, sin, self._slots(batch, cache), single,
                            [s for s, n in enumerate(lengths) if n > 1], single_rows, {})

    @torch.inference_mode()
    def layer(self, i: int, h: torch.Tensor, ctx: "LayerContext", kv: tuple[int, torch.Tensor],
              trace: ForwardTrace | None = None, lw: LayerWeights | None = None) -> torch.Tensor:
        """Layer `i` (parallel residual: h + attention(norm h) + MLP(norm h)). `lw` overrides the layer's weights
        and `kv` is (KV group, this layer's slice of the paged cache): checks run one layer at a time in fp32 on another
        backend's inputs this way (per-layer teacher forcing)."""
        cfg, batch = self.cfg, ctx.batch
        lw = lw if lw is not None else self.w.layers[i]
        x = L.norm(h, lw.norm_weight, cfg)
        qkv = F.linear(x, lw.qkv, lw.qkv_bias)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.uses_rope(i):
            q, k = L.apply_rope(q, ctx.cos, ctx.sin), L.apply_rope(k, ctx.cos, ctx.sin)
        g, layer_kv = kv
        blk, off = ctx.slots[g]
        layer_kv[blk, 0, off] = k.to(layer_kv.dtype)
        layer_kv[blk, 1, off] = v.to(layer_kv.dtype)
        window = cfg.window_for(i)
        attn = torch.empty(q.shape[0], cfg.q_size, device=q.device, dtype=q.dtype)
        if ctx.single:      # one new token per sequence: all rows in one batched attention
            if g not in ctx.plans:     # the same for every layer of this KV group
                ctx.plans[g] = L.plan_decode_attention(batch.positions[ctx.single_rows],
                                                       [batch.block_tables[s][g] for s in ctx.single], window,
                                                       ctx.block_size, q.dtype)
            attn[ctx.single_rows] = L.paged_decode_attention(q[ctx.single_rows], layer_kv, ctx.plans[g],
                                                             self.scale)
        # the fast path is bf16 only: an fp32 reference (model/reference.py) runs this layer on fp32 tensors
        fast = self.fast_prefill and q.dtype == torch.bfloat16 and layer_kv.dtype == torch.bfloat16
        if ctx.multi and fast:
            from megakernel.ops.prefill_attention import prefill_attention

            prefill_attention(q, attn.view(q.shape), layer_kv, self._prefill_plan(ctx, g), window, self.scale)
        else:
            for s in ctx.multi:
                a, b = batch.starts[s], batch.starts[s + 1]
                attn[a:b] = L.paged_attention(q[a:b], batch.positions[a:b], layer_kv, batch.block_tables[s][g],
                                              window, ctx.block_size, self.scale)
        attn = F.linear(attn, lw.o, lw.o_bias)
        if lw.moe is not None:
            mlp = L.moe(x, lw.moe, cfg, trace.experts if trace is not None else None,
                        grouped=fast and x.shape[0] > 1, logits_out=trace.router_logits if trace is not None else None)
        else:
            mlp = L.swiglu(x, lw.dense)
        return h + attn + mlp

    def _prefill_plan(self, ctx: "LayerContext", g: int):
        """The multi-token chunks' work items in KV group g (built by the first layer that needs them)."""
        key = ("prefill", g)
        if key not in ctx.plans:
            from megakernel.ops.prefill_attention import plan_prefill, rows_per_item

            b = ctx.batch
            pos = b.host_positions()
            chunks = [(b.starts[s], b.starts[s + 1] - b.starts[s], pos[b.starts[s]], b.block_tables[s][g])
                      for s in ctx.multi]
            ctx.plans[key] = plan_prefill(chunks, rows_per_item(self.cfg.num_heads, self.cfg.num_kv_heads),
                                          b.input_ids.device)
        return ctx.plans[key]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = L.norm(h, self.w.final_norm, self.cfg)
        return (F.linear(h, self.w.lm_head) * self.cfg.logit_scale).float()

    def _slots(self, batch: ForwardBatch, cache: KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per group: (block id, offset in block) of every batch token's K/V."""
        bs = cache.layout.block_size
        pos = batch.host_positions()
        out = []
        for g in range(len(cache.layout.groups)):
            blk = []
            for s in range(batch.num_seqs):
                table = batch.block_tables[s][g]
                blk.extend(table[p // bs] for p in pos[batch.starts[s]:batch.starts[s + 1]])
            if any(b < 0 for b in blk):
                raise RuntimeError("a token's KV block was not allocated (or already recycled)")
            dev = batch.positions.device
            out.append((to_device(blk, torch.long, dev), batch.positions % bs))
        return out
