"""Library-speed prefill (Triton paged flash attention, grouped-GEMM experts) against the exact path, layer by
layer on the exact path's own inputs, for ragged multi-token chunks that continue cached prefixes and cross the
sliding window. Without a GPU the Triton kernel runs in Triton's interpreter (conftest.py); on a GPU compiled."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import VARIANTS, clone_cache, make_cfg, prefill_state, tiny_weights
from megakernel.model.cohere2_moe import Cohere2MoeModel, ForwardBatch, ForwardTrace

pytest.importorskip("triton", reason="the prefill attention kernel needs triton (pip install triton)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 on both sides; the exact path rounds attention scores and probabilities to bf16 (as transformers' eager
# attention does), the fast path keeps them in fp32: a layer's update may differ by a few bf16 steps.
UPDATE_REL_TOL = 3e-2


def _chunk_batch(st, extra: list[int], g: torch.Generator) -> ForwardBatch:
    ids, pos, starts, tables = [], [], [0], []
    for i, (seq, n) in enumerate(zip(st.seqs, extra)):
        p = len(st.tokens[i])
        st.blocks.prepare(seq, p, p + n)
        ids += torch.randint(3, st.cfg.vocab_size, (n,), generator=g).tolist()
        pos += range(p, p + n)
        starts.append(len(ids))
        tables.append(seq.tables)
    return ForwardBatch(torch.tensor(ids, device=DEV), torch.tensor(pos, device=DEV), starts, tables,
                        positions_list=pos)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fast_prefill_matches_exact_layer_by_layer(variant):
    cfg = make_cfg(variant)
    w = tiny_weights(cfg, device=DEV, dtype=torch.bfloat16, seed=3, scale=1.0)
    st = prefill_state(cfg, w, [5, 13, 20, 1], device=DEV, seed=3, chunk=7)
    g = torch.Generator().manual_seed(7)
    batch = _chunk_batch(st, [9, 3, 12, 17], g)          # 17 tokens from position 1 cross the window (8)
    exact = Cohere2MoeModel(cfg, w, fast_prefill=False)
    fast = Cohere2MoeModel(cfg, w, fast_prefill=True)
    c_exact, c_fast = clone_cache(st.cache), clone_cache(st.cache)
    tr = ForwardTrace(hidden=[])
    ref_logits = exact.forward(batch, c_exact, tr)
    ctx = fast.prepare(batch, c_fast, torch.bfloat16)
    worst = 0.0
    for i in range(cfg.num_layers):
        t_fast, t_exact = ForwardTrace(), tr.experts
        out = fast.layer(i, tr.hidden[i], ctx, c_fast.layer(i), t_fast)
        d_fast = (out - tr.hidden[i]).float()
        d_ref = (tr.hidden[i + 1] - tr.hidden[i]).float()
        rel = float(((d_fast - d_ref).norm(dim=-1) / d_ref.norm(dim=-1).clamp(min=1e-6)).max())
        worst = max(worst, rel)
        assert rel < UPDATE_REL_TOL, (i, rel)
        if cfg.is_moe(i):          # the same router input routes to the same experts
            m = cfg.moe_layers.index(i)
            assert torch.equal(t_fast.experts[0].sort(-1).values, t_exact[m].sort(-1).values)
    for a, b in zip(c_fast.kv, c_exact.kv):             # the chunk's K/V written identically
        assert torch.equal(a, b)
    logits = fast.forward(batch, clone_cache(st.cache))
    cos = torch.nn.functional.cosine_similarity(logits, ref_logits, dim=-1)
    print(f"{variant}: worst layer-update relative error {worst:.2e}; end-to-end logits cosine min {cos.min():.5f}")
    assert cos.min() > 0.99


def _visible_split(pos0: int, n: int, window: int | None, block_n: int) -> tuple[int, int]:
    """The kernel's [a, b): key tiles visible to every query of an item (as prefill_attn_kernel computes it)."""
    b = (pos0 + 1) // block_n * block_n
    lo_all = max(pos0 + n - window, 0) if window else 0
    return min(-(-lo_all // block_n) * block_n, b), b


@pytest.mark.parametrize("window", [None, 24, 70])
@pytest.mark.parametrize("heads,kv_heads,head_dim,bs", [(4, 2, 16, 8), (6, 2, 24, 8), (4, 2, 16, 32)])
def test_prefill_kernel_unmasked_tiles_match_reference(window, heads, kv_heads, head_dim, bs):
    """Ragged chunks far enough past their offsets that key tiles are fully visible (the unmasked loop), the window's
    lower edge and the diagonal masked, several sequences in one launch, against fp32 attention. head_dim 24 pads
    the tile's columns, 3 query heads per kv head pad its rows; 8-token blocks give each key of a tile its own block
    id, 32-token blocks one per tile."""
    from megakernel.ops.prefill_attention import (PrefillAttnTuning, plan_prefill, prefill_attention,
                                                  prefill_attention_reference, rows_per_item)

    tuning = PrefillAttnTuning(block_n=16, num_warps=4, num_stages=2, block_rows=32)
    scale = head_dim ** -0.5
    g = torch.Generator().manual_seed(11)
    specs = [(0, 21), (133, 37), (70, 5), (16, 16)]              # (first position, tokens) per sequence
    nblk = sum((p + n + bs - 1) // bs for p, n in specs) + 3
    perm = torch.randperm(nblk, generator=g).tolist()
    kv = torch.randn(nblk, 2, bs, kv_heads, head_dim, generator=g).to(torch.bfloat16).to(DEV)
    T = sum(n for _, n in specs)
    q = torch.randn(T, heads, head_dim, generator=g).to(torch.bfloat16).to(DEV)
    chunks, row, used = [], 0, 0
    for p, n in specs:
        m = (p + n + bs - 1) // bs
        chunks.append((row, n, p, perm[used:used + m]))
        row, used = row + n, used + m
    block_m = rows_per_item(heads, kv_heads, tuning)
    plan = plan_prefill(chunks, block_m, torch.device(DEV))
    last = [int(r[2] + r[1]) for r in plan.items.cpu()]
    assert last == sorted(last, reverse=True)                     # heaviest first
    splits = [_visible_split(int(r[2]), int(r[1]), window, tuning.block_n) for r in plan.items.cpu()]
    assert any(b > a for a, b in splits)                          # the unmasked loop runs
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, out, kv, plan, window, scale, tuning)
    for row0, n, p, table in chunks:
        ref = prefill_attention_reference(q[row0:row0 + n], kv, table, torch.arange(p, p + n), window, scale)
        err = float((out[row0:row0 + n].float() - ref).abs().max())
        assert err < 2e-2, (p, n, err)


def test_prefill_tuning_from_env_spec():
    from megakernel.ops.prefill_attention import PrefillAttnTuning

    t = PrefillAttnTuning.parse("block_n=128, num_warps=4,num_stages=3")
    assert (t.block_n, t.num_warps, t.num_stages, t.block_rows) == (128, 4, 3, PrefillAttnTuning().block_rows)
    assert PrefillAttnTuning.parse("") == PrefillAttnTuning()
    for bad in ("blockn=64", "block_n", "num_warps=x", "block_n=48", "num_stages=0"):
        with pytest.raises(ValueError):
            PrefillAttnTuning.parse(bad)
