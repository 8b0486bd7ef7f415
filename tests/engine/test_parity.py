"""The PyTorch path against transformers' Cohere2MoeForCausalLM on tiny checkpoints of every config variant.

Tolerances: fp32 logits within 1e-4 of transformers' relative to the largest reference logit; greedy 64-token
generations identical. Prompts are longer than the sliding window (8) and run as one ragged batch in chunks.
"""

from __future__ import annotations

import pytest
import torch

from megakernel import LLM, SamplingParams
from megakernel.config import ModelConfig
from megakernel.kv.block_manager import BlockManager
from megakernel.kv.cache import KVCache, KVLayout
from megakernel.model.cohere2_moe import Cohere2MoeModel
from megakernel.model.weights import load_checkpoint
from tiny_models import VARIANTS, load_reference, prefill_ragged, write_checkpoint

PROMPT_LENS = (5, 19, 37)   # one under the window, two over it; ragged


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return write_checkpoint(request.param, folder)


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def ragged_prefill_logits(folder, prompts, chunk: int, block_size: int = 4) -> list[torch.Tensor]:
    """Logits at every prompt position, computing all prompts together in one ragged batch per chunk."""
    cfg = ModelConfig.from_pretrained(folder)
    model = Cohere2MoeModel(cfg, load_checkpoint(folder, cfg, progress=False))
    layout = KVLayout.for_model(cfg, block_size)
    n_blocks = [256] * len(layout.groups)
    cache, blocks = KVCache(layout, n_blocks, "cpu", torch.float32), BlockManager(layout, n_blocks)
    return prefill_ragged(model, cache, blocks, prompts, chunk)[1]


@pytest.mark.parametrize("chunk", [7, 64])
def test_prefill_logits_match_transformers(checkpoint, chunk):
    ref = load_reference(checkpoint)
    prompts = _prompts()
    ours = ragged_prefill_logits(checkpoint, prompts, chunk)
    for p, o in zip(prompts, ours):
        with torch.no_grad():
            r = ref(torch.tensor([p])).logits[0].float()
        err = (o - r).abs().max().item() / r.abs().max().item()
        assert err < 1e-4, f"relative logit error {err:.2e} for a prompt of {len(p)} tokens"


def test_greedy_generation_matches_transformers(checkpoint):
    from transformers import GenerationConfig

    ref = load_reference(checkpoint)
    # No EOS on either side: 64 tokens each, whatever they are (generate merges in the model's own EOS otherwise).
    ref.generation_config.eos_token_id = None
    greedy64 = GenerationConfig(max_new_tokens=64, do_sample=False, pad_token_id=0)
    prompts = _prompts(seed=1)
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16,
              progress=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            expect = ref.generate(torch.tensor([p]), generation_config=greedy64)
        assert expect.shape[1] == len(p) + 64
        assert o.token_ids == expect[0, len(p):].tolist()
        assert o.finish_reason == "length"
    assert llm.engine.num_kv_blocks_in_use() == 0
