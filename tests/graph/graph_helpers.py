"""Checking another decode backend's step against the PyTorch path's on the tiny configs (CPU or GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakernel.model.cohere2_moe import ForwardTrace


def small_tiles():
    """A tuning with 16-key tiles and 3 splits, so the tiny tests' short contexts span several tiles and splits."""
    from megakernel.graph.backend import GraphTuning

    class SmallTiles(GraphTuning):
        def attention(self, rows: int) -> dict:
            return {**super().attention(rows), "nsplit": 3, "block_t": 16}

    return SmallTiles()


def cos_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.float(), b.float(), dim=-1)


def near_tie_rows(router_logits: list[torch.Tensor], k: int, margin: float = 0.02) -> set[int]:
    """Rows whose routing sits on a near tie (k-th vs (k+1)-th of the backend's own router logits, within `margin`
    of the largest) in some MoE layer: there two bf16 implementations may pick different experts. The megakernel
    tests use the same rule on the kernel's logits."""
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
    its routing is a near tie in the backend's own router logits. The new K/V within bf16 rounding when no row is
    exempt. Expert sets equal in every (row, layer) off near ties, except the counted mismatches: the PyTorch path
    rounds attention scores to bf16 before the softmax and the backends do not, which can move a router logit by a
    few percent; such a row must still meet the logits bounds."""
    assert not torch.isnan(out).any()
    cos = cos_rows(out, ref)
    ties = near_tie_rows(trace_out.router_logits, k)
    ok = cos >= 0.999
    bad = [r for r in range(out.shape[0]) if not ok[r]]
    assert all(r in ties for r in bad), (bad, cos.tolist(), ties)
    if bool(ok.any()):
        err = float(((out - ref).norm(dim=-1) / ref.norm(dim=-1))[ok].max())
        assert err < 5e-2, err
    if not bad:
        for a, b in zip(cache_out.kv, cache_ref.kv):
            assert float((a.float() - b.float()).abs().max()) < 0.05 * float(b.float().abs().max())
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
    return len(bad), mismatches
