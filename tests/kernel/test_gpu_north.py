"""Issue 3's North-dims bars, short version (the full 12 shapes x 256 steps: benchmarks/north_acceptance.py).

Random bf16 weights at North Mini Code's dimensions; 16 teacher-forced steps at two shapes (one crosses the
sliding window). Each megakernel layer is compared with that layer in fp32 on the kernel's own input: logits
cosine >= 0.999 every step, argmax >= 98% where the reference is confident, expert sets >= 95% with every swap at
a router near-tie, residual stream cosine >= 0.999 on rows whose experts agree.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs an sm_90 GPU")]


@pytest.fixture(scope="module")
def north():
    from megakernel.config import north_mini_code_config
    from megakernel.model.cohere2_moe import Cohere2MoeModel
    from megakernel.model.weights import random_weights

    cfg = north_mini_code_config()
    w = random_weights(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    yield cfg, w, Cohere2MoeModel(cfg, w)
    del w
    torch.cuda.empty_cache()


@pytest.mark.parametrize("B,ctx", [(1, 100), (5, 4200)])
def test_north_dims_per_layer(north, B, ctx):
    from benchmarks.north_acceptance import run_shape, verdict

    cfg, w, model = north
    r = run_shape(cfg, w, model, B, ctx, steps=16, seed=7)
    pl = r["per_layer"]
    print(B, ctx, {k: v for k, v in pl.items() if k != "layers"})
    assert all(verdict(r).values()), verdict(r)
    assert pl["expert_mismatches"] == pl["mismatches_at_near_ties"]
    assert pl["update_rel_err_max"] < 0.05
