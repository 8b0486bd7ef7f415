"""GPU checks of the PyTorch path (run through the device tool): bf16 parity on CUDA, and North Mini Code's real
dimensions with random weights on a ragged batch of 8."""

from __future__ import annotations

import time

import pytest
import torch

from megakernel import LLM, SamplingParams
from megakernel.config import north_mini_code_config
from megakernel.engine.llm_engine import LLMEngine
from megakernel.model.weights import random_weights
from tiny_models import VARIANTS, load_reference, write_checkpoint

pytestmark = pytest.mark.gpu

# The tiny checkpoints have large random weights, so bf16 rounding flips expert choices and transformers' own bf16
# run lands 1e-2..1.5e-1 (relative L2) from fp32. The parity asked for is "at bf16 tolerance": our bf16 logits
# must sit within 2e-2 of transformers' bf16 logits, and no further from fp32 than transformers' bf16 (+10%).
BF16_REL_L2 = 2e-2


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bf16_cuda_parity_against_fp32_reference(variant, tmp_path):
    folder = write_checkpoint(variant, tmp_path / variant)
    ref32 = load_reference(folder, torch.float32, "cuda")
    ref16 = load_reference(folder, torch.bfloat16, "cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 19, 37)]
    # the exact path (transformers' op order and bf16 roundings); the fast prefill is checked against it per layer
    # in tests/graph/test_prefill.py
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", backend="torch", block_size=4,
              max_num_batched_tokens=16, progress=False, fast_prefill=False)
    engine = llm.engine
    for p in prompts:
        x = torch.tensor([p], device="cuda")
        with torch.no_grad():
            r32 = ref32(x).logits[0, -1].float()
            r16 = ref16(x).logits[0, -1].float()
        # our last-position logits through the engine's own prefill
        engine.add_request("q", p, SamplingParams(temperature=0, max_tokens=1, logprobs=0))
        chunks = engine.scheduler.schedule()
        while not chunks[0].samples:
            engine.runner.run(chunks)
            for c in chunks:
                c.seq.num_computed = c.end
            chunks = engine.scheduler.schedule()
        _, ours, _ = engine.runner.run(chunks)
        engine.abort_request("q")
        ours = ours[0].float()
        err = ((ours - r32).norm() / r32.norm()).item()
        hf_err = ((r16 - r32).norm() / r32.norm()).item()
        vs_hf16 = ((ours - r16).norm() / r16.norm()).item()
        print(f"{variant} len {len(p)}: rel-L2 vs fp32: ours bf16 {err:.2e}, transformers bf16 {hf_err:.2e}; "
              f"ours vs transformers bf16 {vs_hf16:.2e}")
        assert torch.isfinite(ours).all()
        assert vs_hf16 < BF16_REL_L2
        assert err <= 1.1 * hf_err + 1e-3


def test_north_dims_random_weights_ragged_batch_of_8():
    cfg = north_mini_code_config()
    t0 = time.perf_counter()
    weights = random_weights(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    torch.cuda.synchronize()
    built = time.perf_counter() - t0
    print(f"random North weights: {weights.num_bytes() / 1e9:.1f} GB built in {built:.1f} s")
    assert built < 60
    engine = LLMEngine(config=cfg, weights=weights, device="cuda", backend="torch", max_num_seqs=8,
                       max_model_len=8192, kv_cache_memory=16 << 30, progress=False)
    lens = [17, 100, 700, 1500, 4100, 33, 2, 900]     # ragged; 4100 crosses the 4096 window
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate(lens):
        engine.add_request(f"r{i}", torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(),
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1))
    seen, t0 = {}, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] = out
    torch.cuda.synchronize()
    print(f"prefill {sum(lens)} tokens + 4 decode steps x 8 rows: {time.perf_counter() - t0:.1f} s")
    assert len(seen) == 8
    for out in seen.values():
        assert len(out.token_ids) == 4
        assert all(torch.isfinite(torch.tensor(lp.logprob)) for lp in out.outputs[0].logprobs)
    # finite logits for the ragged batch directly
    assert engine.num_kv_blocks_in_use() == 0
