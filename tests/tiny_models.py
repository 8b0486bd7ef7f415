"""Tiny random cohere2_moe checkpoints written by transformers' own save_pretrained, covering the config variants."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    vocab_size=512, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=5,
    intermediate_size=32, prefix_dense_intermediate_size=96, num_experts=8, num_experts_per_tok=2,
    first_k_dense_replace=1, expert_selection_fn="sigmoid", norm_topk_prob=False, sliding_window=8, rope_theta=5e4,
    rms_norm_eps=1e-6, logit_scale=1.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    max_position_embeddings=4096,
)

# name -> overrides of BASE. Together they cover: sigmoid and softmax routing, with and without renormalisation,
# shared experts (sum and average), LayerNorm, several dense prefix layers, logit_scale != 1, attention bias,
# untied embeddings, and a dense prefix without RoPE.
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


def config_kwargs(name: str) -> dict:
    """Cohere2MoeConfig keyword arguments of a variant (layer_types explicit, North's 3:1 pattern)."""
    kw = {**BASE, **VARIANTS[name]}
    n = kw["num_hidden_layers"]
    if "prefix_dense_sliding_window_pattern" not in VARIANTS[name]:
        kw["layer_types"] = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)]
    return kw


def make_config(name: str):
    from transformers import Cohere2MoeConfig

    return Cohere2MoeConfig(**config_kwargs(name))


def prefill_ragged(model, cache, blocks, prompts: list[list[int]], chunk: int, device="cpu"):
    """Prefill ragged prompts together, `chunk` tokens per prompt per step, with the PyTorch path.

    Returns the sequences' block tables and, per prompt, the logits of every prompt position.
    """
    from megakernel.model.cohere2_moe import ForwardBatch

    seqs = [blocks.new_sequence() for _ in prompts]
    done = [0] * len(prompts)
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        active = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        ids, pos, starts, tables = [], [], [0], []
        for i in active:
            s, e = done[i], min(len(prompts[i]), done[i] + chunk)
            blocks.prepare(seqs[i], s, e)
            ids += prompts[i][s:e]
            pos += range(s, e)
            starts.append(len(ids))
            tables.append(seqs[i].tables)
        batch = ForwardBatch(torch.tensor(ids, device=device), torch.tensor(pos, device=device), starts, tables,
                             logits_rows=torch.arange(len(ids), device=device))
        logits = model.forward(batch, cache)
        for j, i in enumerate(active):
            out[i].append(logits[starts[j]:starts[j + 1]])
            done[i] = min(len(prompts[i]), done[i] + chunk)
    return seqs, [torch.cat(o) for o in out]


def write_checkpoint(name: str, folder: Path, seed: int = 0, **save_kwargs) -> Path:
    from transformers import Cohere2MoeForCausalLM

    torch.manual_seed(seed)
    model = Cohere2MoeForCausalLM(make_config(name))
    # transformers initialises with std 0.02: scale up so routing and attention are far from uniform.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            else:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, **save_kwargs)
    return folder


def load_reference(folder: Path, dtype=torch.float32, device="cpu"):
    from transformers import Cohere2MoeForCausalLM

    return Cohere2MoeForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=dtype).to(device).eval()
