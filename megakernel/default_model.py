"""The embedded default model: what `serve` and `generate` use when no --model is given."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("megakernel")

EMBEDDED = Path(__file__).parent / "models" / "north_nano"


def resolve_model_path(model: str | Path | None) -> Path:
    if model is not None:
        return Path(model).expanduser()
    if (EMBEDDED / "config.json").exists():
        return EMBEDDED
    return tiny_random_checkpoint()


def tiny_random_checkpoint(folder: Path | None = None) -> Path:
    """A tiny randomly initialised cohere2_moe checkpoint (no tokenizer), created once and cached.

    Stand-in used only when the package ships no trained embedded model: it serves token-id prompts and
    produces random tokens.
    """
    folder = folder or Path.home() / ".cache" / "megakernel" / "tiny-random-cohere2-moe"
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM

    log.warning("megakernel: no embedded model shipped; creating a tiny RANDOM model at %s", folder)
    torch.manual_seed(0)
    n = 5
    cfg = Cohere2MoeConfig(
        vocab_size=512, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=n, intermediate_size=32, prefix_dense_intermediate_size=96, num_experts=8,
        num_experts_per_tok=2, first_k_dense_replace=1, expert_selection_fn="sigmoid", norm_topk_prob=False,
        sliding_window=32, rope_theta=5e4, rms_norm_eps=1e-6, logit_scale=1.0, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, layer_types=["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)],
    )
    Cohere2MoeForCausalLM(cfg).save_pretrained(folder)
    return folder
