"""The graph backend's decode step (its Triton kernels in Triton's CPU interpreter, no capture) against the
PyTorch path on the tiny config variants, at ragged lengths crossing the sliding window. The GPU tests run the
same step compiled and captured (test_graph_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from backend_checks import check_step
from graph_helpers import small_tiles
from kernel_helpers import VARIANTS, clone_cache, decode_batch, make_cfg, prefill_state, tiny_weights
from megakernel.model.cohere2_moe import Cohere2MoeModel, ForwardTrace

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the compiled kernels are tested")
triton = pytest.importorskip("triton", reason="the graph backend's kernels need triton (pip install triton)")


def _run(variant: str, B: int, steps: int = 6) -> int:
    from megakernel.graph.backend import DecodeBuffers, GraphStep, fuse_router_into_qkv, upload_step

    cfg = make_cfg(variant)
    w = tiny_weights(cfg, device="cpu", dtype=torch.bfloat16, seed=B, scale=1.0)
    g = torch.Generator().manual_seed(B)
    lens = torch.randint(1, 24, (B,), generator=g).tolist()
    st = prefill_state(cfg, w, lens, seed=B)
    model = Cohere2MoeModel(cfg, w)
    qkv = fuse_router_into_qkv(w)
    buf = DecodeBuffers(cfg, st.cache, B, 64, torch.device("cpu"))
    step = GraphStep(cfg, w, qkv, st.cache, buf, B, small_tiles())
    nxt = torch.randint(3, cfg.vocab_size, (B,), generator=g).tolist()
    exempt = mismatched = 0
    for _ in range(steps):                   # crosses the window (8) for every sequence
        batch = decode_batch(st, nxt)
        c_graph = clone_cache(st.cache)
        tr_ref, tr_graph = ForwardTrace(router_logits=[]), ForwardTrace(router_logits=[])
        ref = model.forward(batch, st.cache, tr_ref)
        buf.logits.fill_(float("nan"))
        upload_step(buf, c_graph, batch, 0, B, batch.host_positions())
        step.cache = c_graph
        step.run(tr_graph)
        tr_graph.experts = [t[:B].long() for t in buf.topk]
        e, m = check_step(buf.logits[:B].clone(), ref, cfg.num_experts_per_tok, tr_ref, tr_graph, c_graph,
                          st.cache)
        exempt, mismatched = exempt + e, mismatched + m
        nxt = ref.argmax(-1).tolist()
        for i in range(B):
            st.tokens[i].append(nxt[i])
    assert mismatched <= max(1, B * steps // 8), mismatched
    return exempt


# A row may differ beyond bf16 tolerance only where its routing is a near tie; at most max(1, B * 6 / 8) such
# rows in 6 steps, the megakernel test's bound (random tiny models have many near ties).
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_graph_step_matches_torch(variant):
    assert _run(variant, 3) <= 2


@pytest.mark.slow
@pytest.mark.parametrize("B", [1, 16])
def test_graph_step_matches_torch_batches(B):
    assert _run("north_like", B) <= max(1, B * 6 // 8)


def test_graph_backend_refuses_cpu():
    from megakernel.graph.backend import GraphBackend
    from megakernel.kv.cache import KVCache, KVLayout

    cfg = make_cfg("north_like")
    w = tiny_weights(cfg, dtype=torch.bfloat16)
    layout = KVLayout.for_model(cfg, 4)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        GraphBackend(cfg, w, KVCache(layout, [8, 8], "cpu", torch.bfloat16))


def test_engine_refuses_graph_on_cpu():
    from megakernel import LLM

    from megakernel.errors import ConfigError

    with pytest.raises(ConfigError, match="backend 'graph' needs a CUDA GPU"):
        LLM(device="cpu", backend="graph", progress=False)
