"""Model configuration read from a Hugging Face `config.json` of `model_type: cohere2_moe`.

Every field that changes the math is explicit here; anything we do not implement is refused by name so a
checkpoint never runs with silently different numerics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, asdict
from pathlib import Path
from typing import Any

from megakernel.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("cohere2_moe",)
FULL, SLIDING = "full_attention", "sliding_attention"
DENSE, SPARSE = "dense", "sparse"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]          # FULL or SLIDING per layer (attention mask)
    mlp_layer_types: tuple[str, ...]      # DENSE or SPARSE per layer
    sliding_window: int | None            # keys visible to a query, itself included
    rope_theta: float
    rope_on_dense_prefix: bool            # prefix_dense_sliding_window_pattern == 1: dense layers get RoPE
    dense_intermediate_size: int          # width of the dense (prefix) MLP
    moe_intermediate_size: int            # width of one routed expert
    num_experts: int
    num_experts_per_tok: int
    expert_selection_fn: str              # "sigmoid" or "softmax"
    norm_topk_prob: bool                  # renormalise sigmoid scores over the top-k (ignored for softmax)
    num_shared_experts: int
    shared_expert_combination: str        # "sum" or "average"
    norm_type: str                        # "rms" or "layer"
    norm_eps: float
    logit_scale: float
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING and self.sliding_window is not None

    def uses_rope(self, layer: int) -> bool:
        """transformers rotates q/k on sliding layers, and on dense prefix layers when the pattern is 1."""
        return self.is_sliding(layer) or (self.mlp_layer_types[layer] == DENSE and self.rope_on_dense_prefix)

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == SPARSE

    def window_for(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe(i)]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.exists():
            raise ConfigError(f"no config.json in {path}")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_file} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        raw = dict(raw)
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}: megakernel serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def req(name: str) -> Any:
            if name not in raw or raw[name] is None:
                raise ConfigError(f"config.json lacks required field {name!r}")
            return raw[name]

        hidden = int(req("hidden_size"))
        n_layers = int(req("num_hidden_layers"))
        n_heads = int(req("num_attention_heads"))
        n_kv = int(raw.get("num_key_value_heads") or n_heads)
        head_dim = int(raw.get("head_dim") or hidden // n_heads)
        if n_heads % n_kv:
            raise ConfigError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")

        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"unsupported hidden_act {act!r} (only 'silu')")

        # Layer patterns: explicit lists win; otherwise derive them exactly as transformers does.
        first_k_dense = int(raw.get("first_k_dense_replace", 0) or 0)
        prefix_pattern = int(raw.get("prefix_dense_sliding_window_pattern", 1))
        layer_types = raw.get("layer_types")
        if layer_types is None:
            sw_pattern = int(raw.get("sliding_window_pattern", 4))
            prefix = [SLIDING if (i + 1) % prefix_pattern else FULL for i in range(first_k_dense)]
            rest = [SLIDING if (i + 1) % sw_pattern else FULL for i in range(n_layers - first_k_dense)]
            layer_types = prefix + rest
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            mlp_types = [DENSE if i < first_k_dense else SPARSE for i in range(n_layers)]
        for name, vals, allowed in (("layer_types", layer_types, (FULL, SLIDING)),
                                    ("mlp_layer_types", mlp_types, (DENSE, SPARSE))):
            if len(vals) != n_layers:
                raise ConfigError(f"{name} has {len(vals)} entries for {n_layers} layers")
            bad = sorted(set(vals) - set(allowed))
            if bad:
                raise ConfigError(f"unsupported {name} value(s) {bad}")

        # RoPE: only the default (unscaled) type is implemented.
        rope = raw.get("rope_parameters") or {}
        rope_scaling = raw.get("rope_scaling")
        rope_type = rope.get("rope_type", (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default")))
        if rope_type != "default":
            raise ConfigError(f"unsupported RoPE type {rope_type!r} (only 'default')")
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))

        selection = raw.get("expert_selection_fn", "softmax")
        if selection not in ("sigmoid", "softmax"):
            raise ConfigError(f"unsupported expert_selection_fn {selection!r} (sigmoid or softmax)")
        combination = raw.get("shared_expert_combination_strategy", "average")
        n_shared = int(raw.get("num_shared_experts", 0) or 0)
        if n_shared and combination not in ("sum", "average"):
            raise ConfigError(f"unsupported shared_expert_combination_strategy {combination!r} (sum or average)")

        rms_eps = raw.get("rms_norm_eps")
        norm_type, norm_eps = ("rms", float(rms_eps)) if rms_eps is not None else ("layer", float(raw.get("layer_norm_eps", 1e-5)))

        moe_inter = int(req("intermediate_size"))
        dense_inter = int(raw.get("prefix_dense_intermediate_size") or moe_inter)
        # sliding layers without a sliding_window: transformers builds no window mask, so they attend like full
        # attention layers (window_for returns None)
        sliding = raw.get("sliding_window")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        known = set(cls.__dataclass_fields__)
        return cls(
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            layer_types=tuple(layer_types),
            mlp_layer_types=tuple(mlp_types),
            sliding_window=int(sliding) if sliding is not None else None,
            rope_theta=rope_theta,
            rope_on_dense_prefix=prefix_pattern == 1,
            dense_intermediate_size=dense_inter,
            moe_intermediate_size=moe_inter,
            num_experts=int(raw.get("num_experts", 8)),
            num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
            expert_selection_fn=selection,
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            num_shared_experts=n_shared,
            shared_expert_combination=combination,
            norm_type=norm_type,
            norm_eps=norm_eps,
            logit_scale=float(raw.get("logit_scale", 0.0625)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            attention_bias=bool(raw.get("attention_bias", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            pad_token_id=raw.get("pad_token_id"),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            extra={k: v for k, v in raw.items() if k not in known},
        )


def north_mini_code_config() -> ModelConfig:
    """The released North Mini Code dimensions (for the random-weights builder and benchmarks)."""
    n = 49
    return ModelConfig.from_dict(dict(
        model_type="cohere2_moe", vocab_size=262144, hidden_size=2048, num_hidden_layers=n,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        layer_types=[FULL if i % 4 == 0 else SLIDING for i in range(n)],
        mlp_layer_types=[DENSE if i == 0 else SPARSE for i in range(n)],
        sliding_window=4096, rope_parameters={"rope_theta": 50000.0, "rope_type": "default"},
        prefix_dense_sliding_window_pattern=1, prefix_dense_intermediate_size=3072, intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, expert_selection_fn="sigmoid", norm_topk_prob=False,
        num_shared_experts=0, rms_norm_eps=1e-6, logit_scale=1.0, tie_word_embeddings=True,
        max_position_embeddings=500000, bos_token_id=2, eos_token_id=3, pad_token_id=0,
    ))
