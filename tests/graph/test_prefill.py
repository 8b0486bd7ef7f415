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
