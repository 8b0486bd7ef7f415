"""GPU tests of the decode megakernel (sm_90; run through the device tool). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import VARIANTS, clone_cache, decode_batch, make_cfg, prefill_state, tiny_weights
from megakernel.model.cohere2_moe import Cohere2MoeModel, ForwardTrace

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def _near_tie_rows(be, B, k, margin=0.02):
    """Rows whose routing has a near tie (k-th vs (k+1)-th router logit) in some MoE layer of the last step."""
    rl = be.buf["rlog"][:, :B].float()
    if rl.shape[-1] <= k:
        return set()
    top = rl.topk(k + 1, dim=-1).values
    close = (top[..., k - 1] - top[..., k]).abs() <= margin * top[..., 0].abs().clamp(min=1)
    return set(torch.nonzero(close.any(0)).flatten().tolist())


@needs_sm90
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("B", [1, 3, 8, 16])
def test_tiny_matches_torch(variant, B):
    """Same inputs (cache state, tokens) for both paths at every step; logits within bf16 tolerance. A row may
    differ more only where the expert choice of that row sits on a near tie of bf16 router logits."""
    from megakernel.kernel.backend import MegakernelBackend

    cfg = make_cfg(variant)
    w = tiny_weights(cfg, device="cuda", dtype=torch.bfloat16, seed=B, scale=1.0)
    g = torch.Generator().manual_seed(B)
    lens = torch.randint(1, 30, (B,), generator=g).tolist()
    st = prefill_state(cfg, w, lens, device="cuda", seed=B)
    model = Cohere2MoeModel(cfg, w)
    be = MegakernelBackend(cfg, w, st.layout, max_batch=16, split_tokens=5, watchdog_s=5)
    be.poison = True
    nxt = torch.randint(3, cfg.vocab_size, (B,), generator=g).tolist()
    exempt = 0
    for step in range(6):                     # crosses the window (8) for every sequence
        batch = decode_batch(st, nxt, device="cuda")
        c_mk = clone_cache(st.cache)
        tr_ref, tr_mk = ForwardTrace(), ForwardTrace()
        ref = model.forward(batch, st.cache, tr_ref)
        out = be.decode(batch, c_mk, trace=tr_mk)
        assert not torch.isnan(out).any()
        assert torch.equal(be.last_tokens.long(), out.argmax(-1))
        cos = _cos(out, ref)
        ties = _near_tie_rows(be, B, cfg.num_experts_per_tok)
        for r in range(B):
            if cos[r] < 0.999:
                assert r in ties, (step, r, cos)
                exempt += 1
        ok = cos >= 0.999
        if bool(ok.all()):      # the new token's K/V written like the PyTorch path (bf16 rounding apart)
            for a, b in zip(c_mk.kv, st.cache.kv):
                assert float((a.float() - b.float()).abs().max()) < 0.05 * float(b.float().abs().max())
        if bool(ok.any()):
            err = float(((out - ref).norm(dim=-1) / ref.norm(dim=-1))[ok].max())
            assert err < 5e-2, (step, err)        # bf16 path vs bf16 path (cos 0.999 ~ 4.5%)
        for a, b in zip(tr_mk.experts, tr_ref.experts):
            assert a.shape == b.shape
        nxt = ref.argmax(-1).tolist()
        for i in range(B):
            st.tokens[i].append(nxt[i])
    assert exempt <= max(1, B * 6 // 8), exempt


@needs_sm90
def test_watchdog_reports_and_recovers():
    from megakernel.kernel.backend import MegakernelBackend, MegakernelHang

    cfg = make_cfg("north_like")
    w = tiny_weights(cfg, device="cuda", dtype=torch.bfloat16)
    st = prefill_state(cfg, w, [9, 4], device="cuda")
    be = MegakernelBackend(cfg, w, st.layout, max_batch=4, watchdog_s=0.5)
    batch = decode_batch(st, [5, 6], device="cuda")
    with pytest.raises(MegakernelHang, match="watchdog"):
        be.decode(batch, clone_cache(st.cache), _inject_hang=True)
    ref = Cohere2MoeModel(cfg, w).forward(batch, clone_cache(st.cache))
    out = be.decode(batch, clone_cache(st.cache))
    assert _cos(out, ref).min() > 0.999


@needs_sm90
def test_available():
    from megakernel.kernel.backend import megakernel_available

    ok, why = megakernel_available()
    assert ok, why


@needs_sm90
@pytest.mark.parametrize("variant", ["north_like", "softmax_shared_avg_untied_g4"])
def test_llm_generate_greedy_matches_torch(variant, tmp_path):
    try:
        from megakernel import LLM, SamplingParams
    except ImportError:
        pytest.skip("LLM API not available")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        import tiny_models
    except ImportError:
        pytest.skip("tests/tiny_models.py missing")
    name = variant if variant in tiny_models.VARIANTS else "softmax_shared_avg_untied"
    folder = tiny_models.write_checkpoint(name, tmp_path / name)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 19, 37)]
    sp = SamplingParams(temperature=0, max_tokens=24)
    outs = {}
    for backend in ("torch", "megakernel"):
        llm = LLM(model=str(folder), device="cuda", dtype="bfloat16", backend=backend)
        outs[backend] = [o.outputs[0].token_ids if hasattr(o, "outputs") else o.token_ids
                         for o in llm.generate(prompts, sp)]
        del llm
    # Two bf16 implementations agree until a near-tie of bf16 logits flips one greedy choice; on the device
    # (2026-11-29) the first 11..21 of 24 tokens were identical for every prompt, then the sequences drifted.
    for a, b in zip(outs["megakernel"], outs["torch"]):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert same >= min(8, len(b)), (same, a, b)
