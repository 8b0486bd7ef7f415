"""Shared set-up for the megakernel tests: tiny configs, a prefilled paged cache, decode batches."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from megakernel.config import FULL, SLIDING, ModelConfig
from megakernel.kv.block_manager import BlockManager
from megakernel.kv.cache import KVCache, KVLayout
from megakernel.model.cohere2_moe import Cohere2MoeModel, ForwardBatch
from megakernel.model.weights import random_weights

BASE = dict(
    model_type="cohere2_moe", vocab_size=512, hidden_size=64, head_dim=16, num_attention_heads=4,
    num_key_value_heads=2, num_hidden_layers=5, intermediate_size=32, prefix_dense_intermediate_size=96,
    num_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, expert_selection_fn="sigmoid",
    norm_topk_prob=False, sliding_window=8, rope_parameters={"rope_theta": 5e4, "rope_type": "default"},
    rms_norm_eps=1e-6, logit_scale=1.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    max_position_embeddings=4096,
)

VARIANTS: dict[str, dict] = {
    "north_like": {},
    "softmax_2dense_bias": dict(expert_selection_fn="softmax", first_k_dense_replace=2, logit_scale=0.0625,
                                attention_bias=True, num_hidden_layers=6),
    "sigmoid_renorm_shared_sum_layernorm": dict(norm_topk_prob=True, num_shared_experts=1,
                                                shared_expert_combination_strategy="sum", rms_norm_eps=None,
                                                layer_norm_eps=1e-5, logit_scale=0.5),
    "softmax_shared_avg_untied_g4": dict(expert_selection_fn="softmax", num_shared_experts=2,
                                         shared_expert_combination_strategy="average", tie_word_embeddings=False,
                                         logit_scale=2.0, prefix_dense_sliding_window_pattern=2,
                                         first_k_dense_replace=2, num_hidden_layers=6, num_attention_heads=8,
                                         num_experts=16, num_experts_per_tok=4),
}


def make_cfg(name: str) -> ModelConfig:
    kw = {**BASE, **VARIANTS[name]}
    n = kw["num_hidden_layers"]
    if "prefix_dense_sliding_window_pattern" not in VARIANTS[name]:
        kw["layer_types"] = [FULL if i % 4 == 0 else SLIDING for i in range(n)]
    return ModelConfig.from_dict(kw)


def tiny_weights(cfg: ModelConfig, device="cpu", dtype=torch.float32, seed=0, scale=2.0):
    """Random weights scaled up so attention and routing are far from uniform."""
    w = random_weights(cfg, device=device, dtype=torch.float32, seed=seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    for t in w.tensors():
        if t.dim() >= 2:
            t.mul_(scale)
        else:
            t.add_(torch.randn(t.shape, generator=g, device=device) * 0.05)
    return w.to(dtype=dtype)


@dataclass
class State:
    cfg: ModelConfig
    weights: object
    layout: KVLayout
    cache: KVCache
    blocks: BlockManager
    seqs: list
    tokens: list[list[int]]          # every sequence's tokens so far (prompt + generated)


def prefill_state(cfg, weights, lens, block_size=4, n_blocks=512, seed=0, device="cpu", chunk=7) -> State:
    """Prefill ragged prompts of `lens` tokens with the PyTorch path (chunked, ragged batch)."""
    layout = KVLayout.for_model(cfg, block_size)
    nb = [n_blocks] * len(layout.groups)
    cache = KVCache(layout, nb, device, weights.dtype)
    blocks = BlockManager(layout, nb)
    model = Cohere2MoeModel(cfg, weights)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    seqs = [blocks.new_sequence() for _ in prompts]
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        act = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        ids, pos, starts, tables = [], [], [0], []
        for i in act:
            s, e = done[i], min(len(prompts[i]), done[i] + chunk)
            blocks.prepare(seqs[i], s, e)
            ids += prompts[i][s:e]
            pos += range(s, e)
            starts.append(len(ids))
            tables.append(seqs[i].tables)
        batch = ForwardBatch(torch.tensor(ids, device=device), torch.tensor(pos, device=device), starts, tables)
        model.forward(batch, cache)
        for i in act:
            done[i] = min(len(prompts[i]), done[i] + chunk)
    return State(cfg, weights, layout, cache, blocks, seqs, [list(p) for p in prompts])


def decode_batch(st: State, next_ids: list[int], device="cpu") -> ForwardBatch:
    """Allocate the next position of every sequence and build the one-token-per-sequence batch."""
    ids, pos, starts, tables = [], [], [0], []
    for i, seq in enumerate(st.seqs):
        p = len(st.tokens[i])
        st.blocks.prepare(seq, p, p + 1)
        ids.append(next_ids[i])
        pos.append(p)
        starts.append(len(ids))
        tables.append(seq.tables)
    return ForwardBatch(torch.tensor(ids, device=device), torch.tensor(pos, device=device), starts, tables)


def clone_cache(cache: KVCache) -> KVCache:
    c = copy.copy(cache)
    c.kv = [t.clone() for t in cache.kv]
    return c
