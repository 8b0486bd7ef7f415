"""The layer-at-a-time fp32 references used to check bf16 backends at North dims.

- `fp32_forward` on bf16 weights equals the PyTorch path run on fp32 copies of the weights (within 1e-5 of the
  largest logit: the same ops, possibly fused differently).
- `fp32_layers_on` fed the fp32 path's own residual stream reproduces that stream layer by layer (so it is the
  per-layer teacher-forced reference), and fed the bf16 path's stream it stays within bf16 rounding of it.
"""

from __future__ import annotations

import pytest
import torch

from megakernel.config import ModelConfig
from megakernel.kv.block_manager import BlockManager
from megakernel.kv.cache import KVCache, KVLayout
from megakernel.model import layers as L
from megakernel.model.cohere2_moe import Cohere2MoeModel, ForwardBatch, ForwardTrace
from megakernel.model.reference import fp32_forward, fp32_layers_on, router_gap
from megakernel.model.weights import random_weights
from tiny_models import config_kwargs


def _setup(variant: str, lens: list[int]):
    cfg = ModelConfig.from_dict({"model_type": "cohere2_moe", **config_kwargs(variant)})
    w = random_weights(cfg, "cpu", torch.bfloat16, seed=3)
    layout = KVLayout.for_model(cfg, 4)
    n = [64] * len(layout.groups)
    blocks = BlockManager(layout, n)
    seqs = [blocks.new_sequence() for _ in lens]
    for s, m in zip(seqs, lens):
        blocks.prepare(s, 0, m)
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.randint(3, cfg.vocab_size, (m,), generator=g) for m in lens])
    pos = torch.cat([torch.arange(m) for m in lens])
    starts = [0]
    for m in lens:
        starts.append(starts[-1] + m)
    batch = ForwardBatch(ids, pos, starts, [s.tables for s in seqs], logits_rows=torch.arange(len(ids)))
    return cfg, w, layout, n, batch


@pytest.mark.parametrize("variant", ["north_like", "softmax_2dense_bias"])
def test_fp32_forward_matches_fp32_model(variant):
    cfg, w, layout, n, batch = _setup(variant, [11, 3, 17])
    ref = Cohere2MoeModel(cfg, w.to(dtype=torch.float32)).forward(batch, KVCache(layout, n, "cpu", torch.float32))
    cache = KVCache(layout, n, "cpu", torch.bfloat16)
    out = fp32_forward(Cohere2MoeModel(cfg, w), batch, cache)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert all(int(t.count_nonzero()) == 0 for t in cache.kv), "the reference must not write the cache"


def test_teacher_forced_layers():
    cfg, w, layout, n, batch = _setup("north_like", [9, 14])
    model = Cohere2MoeModel(cfg, w)
    # its own fp32 stream in: the same stream out
    trace = ForwardTrace(hidden=[])
    fp32_forward(model, batch, KVCache(layout, n, "cpu", torch.bfloat16), trace)
    outs = fp32_layers_on(model, batch, KVCache(layout, n, "cpu", torch.bfloat16), trace.hidden[:-1])
    for i, o in enumerate(outs):
        assert torch.allclose(o, trace.hidden[i + 1], rtol=0, atol=1e-5 * float(trace.hidden[i + 1].abs().max()))
    # the bf16 path's stream in: each layer's bf16 output within bf16 rounding of the fp32 layer on that input
    tb = ForwardTrace(hidden=[])
    model.forward(batch, KVCache(layout, n, "cpu", torch.bfloat16), tb)
    tf = ForwardTrace()
    outs = fp32_layers_on(model, batch, KVCache(layout, n, "cpu", torch.bfloat16), tb.hidden[:-1], tf)
    for i, o in enumerate(outs):
        delta_ref, delta = o - tb.hidden[i].float(), tb.hidden[i + 1].float() - tb.hidden[i].float()
        rel = (delta - delta_ref).norm() / delta_ref.norm()
        assert rel < 0.02, f"layer {i}: relative error of the layer's update {rel:.4f}"
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    gaps = torch.stack([router_gap(model, i, tb.hidden[i]) for i in moe_layers])     # [MoE layers, tokens]
    assert gaps.shape == (len(moe_layers), batch.input_ids.numel())
    # every routing the fp32 router makes with a clear margin (a gap of 5% of the median gap or more; bf16 rounding
    # moves router logits by less) is the bf16 path's too: the two split only at near ties
    split = [(j, r) for j, (ea, eb) in enumerate(zip(tb.experts, tf.experts))
             for r, (a, b) in enumerate(zip(ea.tolist(), eb.tolist())) if set(a) != set(b)]
    assert all(gaps[j, r] < 0.05 * gaps.median() for j, r in split), [(j, r, float(gaps[j, r])) for j, r in split]
    agree = sum(len(set(a.tolist()) & set(b.tolist())) for ea, eb in zip(tb.experts, tf.experts)
                for a, b in zip(ea, eb))
    total = sum(e.numel() for e in tb.experts)
    assert agree >= 0.95 * total


def test_router_gap_is_the_margin_of_the_kth_expert():
    """router_gap is the k-th minus the (k+1)-th fp32 router logit of each row: 0 on an exact tie, and exactly the
    margin that a perturbation of that size would need to change the top-k."""
    cfg, w, layout, n, batch = _setup("north_like", [9, 14])
    model = Cohere2MoeModel(cfg, w)
    layer = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
    h = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    k = cfg.num_experts_per_tok
    x = L.norm(h.float(), w.layers[layer].norm_weight.float(), cfg)
    logits = x @ w.layers[layer].moe.router.float().T
    desc = logits.sort(dim=-1, descending=True).values
    assert torch.allclose(router_gap(model, layer, h), desc[:, k - 1] - desc[:, k], atol=1e-6)
    # move the (k+1)-th expert's router row so that row 0 ties exactly: the gap there drops to 0
    order = logits[0].argsort(descending=True)
    moe = w.layers[layer].moe
    original = moe.router
    router = original.float().clone()
    router[order[k]] += (desc[0, k - 1] - desc[0, k]) / x[0].pow(2).sum() * x[0]
    moe.router = router
    try:
        gap = router_gap(model, layer, h)
    finally:
        moe.router = original
    assert abs(float(gap[0])) < 1e-4 * float(desc[0, 0].abs())
