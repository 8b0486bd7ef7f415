"""backend_checks.check_step, the rule the graph and megakernel tests judge a decode step by, on made-up steps:
it passes a faithful step, counts what it exempts, and fails a wrong row, even one on a router near tie."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backend_checks import check_step
from megakernel.model.batch import ForwardTrace

K = 2


def _step(B: int = 4, V: int = 64, tie_rows: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(B, V, generator=g) * 3
    router = torch.tensor([[4.0, 3.0, 1.0, 0.0]]).repeat(B, 1)       # top-2 clear of the third: no tie
    for r in tie_rows:
        router[r] = torch.tensor([4.0, 2.0, 1.99, 0.0])              # 2nd and 3rd within 2% of the largest
    experts = torch.tensor([[0, 1]]).repeat(B, 1)
    tr_ref = ForwardTrace(experts=[experts.clone()])
    tr_out = ForwardTrace(experts=[experts.clone()], router_logits=[router])
    cache = SimpleNamespace(kv=[torch.ones(2, 3)])
    return ref, tr_ref, tr_out, cache


def test_a_faithful_step_passes_with_nothing_exempt():
    ref, tr_ref, tr_out, cache = _step()
    out = ref + 1e-3 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    assert check_step(out, ref, K, tr_ref, tr_out, cache, cache) == (0, 0)


def test_a_row_off_a_tie_must_match():
    ref, tr_ref, tr_out, cache = _step()
    out = ref.clone()
    out[1] = ref[1] + 0.3 * ref[1].norm() / ref.shape[1] ** 0.5 * torch.randn(ref.shape[1])
    with pytest.raises(AssertionError):
        check_step(out, ref, K, tr_ref, tr_out, cache, cache)


def test_a_row_on_a_tie_is_exempt_within_its_bound():
    ref, tr_ref, tr_out, cache = _step(tie_rows=(2,))
    out = ref.clone()
    out[2] = 0.9 * ref[2] + 0.3 * ref[2].norm() / ref.shape[1] ** 0.5 * torch.randn(ref.shape[1])   # cos ~0.95
    assert check_step(out, ref, K, tr_ref, tr_out, cache, cache) == (1, 0)
    out[2] = ref[3]                                   # another row's logits: wrong even on a tie
    with pytest.raises(AssertionError):
        check_step(out, ref, K, tr_ref, tr_out, cache, cache)


def test_expert_sets_off_a_tie_are_counted_and_nans_fail():
    ref, tr_ref, tr_out, cache = _step()
    tr_out.experts[0][3] = torch.tensor([0, 2])
    assert check_step(ref.clone(), ref, K, tr_ref, tr_out, cache, cache) == (0, 1)
    out = ref.clone()
    out[0, 0] = float("nan")
    with pytest.raises(AssertionError):
        check_step(out, ref, K, tr_ref, tr_out, cache, cache)
