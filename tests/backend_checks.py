"""Checking a decode backend's step (graph backend, megakernel) against the PyTorch path's on the tiny configs, on
the CPU or the GPU: logits bounds on every row, rows on a router near tie exempt within a looser bound and counted,
expert-set mismatches off near ties counted."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakernel.model.batch import ForwardTrace

# The bound of an exempt row (one whose routing sits on a near tie, where the backend may pick another expert).
# Calibrated on CPU with the PyTorch path itself on the megakernel test's configs and seeds (4 variants x batch
# 1..16 x 6 steps): forcing the other expert at every near tie moves a row's logits to cosine 0.65 at worst
# (relative error 0.85; median cosine 0.984), while another row's logits score cosine 0.43 at most (median 0) and
# garbage scores ~0, so these bounds tell "went its own way at a tie" from "wrong".
EXEMPT_COS = 0.5
EXEMPT_REL = 1.0


def cos_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.float(), b.float(), dim=-1)


def near_tie_rows(router_logits: list[torch.Tensor], k: int, margin: float = 0.02) -> set[int]:
    """Rows whose routing sits on a near tie (k-th vs (k+1)-th of the backend's own router logits, within `margin`
    of the largest) in some MoE layer: there two bf16 implementations may pick different experts."""
    rows: set[int] = set()
    for lg in router_logits:
        if lg.shape[-1] <= k:
            continue
        top = lg.float().topk(k + 1, dim=-1).values
        close = (top[:, k - 1] - top[:, k]).abs() <= margin * top[:, 0].abs().clamp(min=1)
        rows |= set(torch.nonzero(close).flatten().tolist())
    return rows


def check_step(out: torch.Tensor, ref: torch.Tensor, k: int, trace_ref: ForwardTrace, trace_out: ForwardTrace,
               cache_out, cache_ref) -> tuple[int, int]:
    """Assert one decode step of another backend against the PyTorch path's. Returns (exempt rows, expert-set
    mismatches outside near ties) for the caller to bound.

    Every row not exempt: logits cosine >= 0.999 and relative error < 5%. A row is exempt (differs more) only where
    its routing is a near tie in some MoE layer, in the backend's own router logits or in the PyTorch path's (when
    its trace recorded them: a tie in either implementation can flip), and even then within EXEMPT_COS / EXEMPT_REL.
    The new K/V within bf16 rounding when no row is exempt. Expert sets equal in every (row, layer) off near ties, except the counted mismatches: the PyTorch path
    rounds attention scores to bf16 before the softmax and the backends do not, which can move a router logit by a
    few percent; such a row must still meet the logits bounds."""
    assert not torch.isnan(out).any()
    cos = cos_rows(out, ref)
    rel = (out - ref).float().norm(dim=-1) / ref.float().norm(dim=-1)
    ties = near_tie_rows(trace_out.router_logits, k) | near_tie_rows(trace_ref.router_logits or [], k)
    # expert sets first, so that a failing logits bound below comes with the routing differences that explain it
    assert len(trace_out.experts) == len(trace_ref.experts)
    mismatches = 0
    for j, (a, b) in enumerate(zip(trace_out.experts, trace_ref.experts)):
        assert a.shape == b.shape
        for r in range(a.shape[0]):
            if r not in ties and sorted(a[r].tolist()) != sorted(b[r].tolist()):
                lg = trace_out.router_logits[j][r].float()
                top = lg.topk(min(lg.numel(), k + 2))
                print(f"  expert sets differ off a near tie: MoE layer {j}, row {r}: {sorted(a[r].tolist())} vs "
                      f"{sorted(b[r].tolist())}; backend's top logits {top.values.tolist()} at {top.indices.tolist()}"
                      f"; logits cos {float(cos[r]):.5f}")
                mismatches += 1
    ok = cos >= 0.999
    bad = [r for r in range(out.shape[0]) if not ok[r]]
    assert all(r in ties for r in bad), (bad, cos.tolist(), ties)
    for r in bad:
        assert cos[r] >= EXEMPT_COS and rel[r] < EXEMPT_REL, (r, float(cos[r]), float(rel[r]))
    if bool(ok.any()):
        err = float(rel[ok].max())
        assert err < 5e-2, err
    if not bad:
        for a, b in zip(cache_out.kv, cache_ref.kv):
            assert float((a.float() - b.float()).abs().max()) < 0.05 * float(b.float().abs().max())
    return len(bad), mismatches


def assert_decode_launches_never_sync(backend: str) -> None:
    """Scheduling and launching decode steps on `backend` (inputs, the step, sampling with every option that keeps
    state across steps) makes no host/device synchronisation: torch's sync debug mode turns any of torch's into an
    error, and (for waits torch cannot see: a CUDA call inside the backend's own library) from the third decode
    launch on, each launch is queued behind ~50 ms of GPU sleep on the launch stream and must return while the GPU
    still sleeps."""
    from megakernel import LLM, SamplingParams

    llm = LLM(device="cuda", dtype="bfloat16", backend=backend, progress=False)
    eng = llm.engine
    launch = eng._launch
    checked = {"n": 0, "behind_sleep": 0}

    def strict_launch(chunks):
        if not all(c.is_decode for c in chunks):
            return launch(chunks)                 # steps with prefill chunks may read device values
        checked["n"] += 1
        behind = checked["n"] > 2                 # (the first launches may set up: pinned buffers, events)
        if behind:
            torch.cuda._sleep(100_000_000)        # ~50 ms at ~2 GHz, ahead of this launch on its stream
            slept = torch.cuda.Event()
            slept.record()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = launch(chunks)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if behind:
            assert not slept.query(), "a decode launch waited for the GPU (the sleep queued before it had ended)"
            checked["behind_sleep"] += 1
        return out

    eng._launch = strict_launch
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=1, max_tokens=24,
                             presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=20,
                             logit_bias={40: 2.0}, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)]
    outs = llm.generate(["def add(a, b):", "class Stack:", "import os"], params, use_tqdm=False)
    assert llm.engine.runner.backend_name == backend
    assert checked["n"] >= 20 and checked["behind_sleep"] >= 18
    assert [len(o.outputs[0].token_ids) for o in outs] == [24, 24, 24]
