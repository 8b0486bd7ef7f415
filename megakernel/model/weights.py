"""Model weights in the layout our kernels want, loaded from safetensors or built at random.

Layout (all [out, in], row-major, as in the checkpoint):
- attention: q, k and v fused into one `qkv` matrix [q_size + 2 * kv_size, hidden] (q rows first).
- dense MLP: `gate_up` [2 * width, hidden] (gate rows first), `down` [hidden, width].
- routed experts stacked: `experts_gate_up` [E, 2 * width, hidden], `experts_down` [E, hidden, width].
Fused and stacked layouts let a GEMV tile read one contiguous slab and let the PyTorch path do one matmul.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from megakernel.config import ModelConfig
from megakernel.errors import CheckpointError


@dataclass
class MLPWeights:
    gate_up: torch.Tensor                 # [2*I, H]
    down: torch.Tensor                    # [H, I]


@dataclass
class MoEWeights:
    router: torch.Tensor                  # [E, H]
    experts_gate_up: torch.Tensor         # [E, 2*I, H]
    experts_down: torch.Tensor            # [E, H, I]
    shared: MLPWeights | None = None


@dataclass
class LayerWeights:
    norm_weight: torch.Tensor             # [H]
    qkv: torch.Tensor                     # [Q + 2KV, H]
    o: torch.Tensor                       # [H, Q]
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    dense: MLPWeights | None = None
    moe: MoEWeights | None = None


@dataclass
class ModelWeights:
    embed: torch.Tensor                   # [V, H]
    final_norm: torch.Tensor              # [H]
    lm_head: torch.Tensor                 # [V, H]; the same storage as `embed` when tied
    layers: list[LayerWeights] = field(default_factory=list)

    def tensors(self) -> Iterator[torch.Tensor]:
        seen: set[int] = set()
        for t in _walk(self):
            if id(t) not in seen:
                seen.add(id(t))
                yield t

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "ModelWeights":
        moved: dict[int, torch.Tensor] = {}

        def mv(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in moved:
                moved[id(t)] = t.to(device=device, dtype=dtype)
            return moved[id(t)]

        return _map(self, mv)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype


def _walk(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list):
        for x in obj:
            yield from _walk(x)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _walk(getattr(obj, name))


def _map(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [_map(x, fn) for x in obj]
    if hasattr(obj, "__dataclass_fields__"):
        return type(obj)(**{n: _map(getattr(obj, n), fn) for n in obj.__dataclass_fields__})
    return obj


# ---------------------------------------------------------------------------------------------------------------
# Expected checkpoint tensors
# ---------------------------------------------------------------------------------------------------------------

def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a Hugging Face checkpoint of this config holds (per-expert layout), with its shape."""
    H, Q, KV = cfg.hidden_size, cfg.q_size, cfg.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        for name, rows in (("q", Q), ("k", KV), ("v", KV)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, H)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (H, Q)
        if cfg.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        if cfg.is_moe(i):
            I = cfg.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (cfg.num_experts, H)
            for e in range(cfg.num_experts):
                q = p + f"mlp.experts.{e}."
                shapes[q + "gate_proj.weight"] = (I, H)
                shapes[q + "up_proj.weight"] = (I, H)
                shapes[q + "down_proj.weight"] = (H, I)
            if cfg.num_shared_experts:
                Is = I * cfg.num_shared_experts
                shapes[p + "mlp.shared_experts.gate_proj.weight"] = (Is, H)
                shapes[p + "mlp.shared_experts.up_proj.weight"] = (Is, H)
                shapes[p + "mlp.shared_experts.down_proj.weight"] = (H, Is)
        else:
            I = cfg.dense_intermediate_size
            shapes[p + "mlp.gate_proj.weight"] = (I, H)
            shapes[p + "mlp.up_proj.weight"] = (I, H)
            shapes[p + "mlp.down_proj.weight"] = (H, I)
    return shapes


# Fused expert tensors some exporters write instead of per-expert ones: name -> (per-expert parts, axis split)
_FUSED_EXPERT_RE = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class _CheckpointReader:
    """Memory-mapped access to every tensor of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
            files = sorted(set(weight_map.values()))
        elif (folder / "model.safetensors").exists():
            files = ["model.safetensors"]
            weight_map = {}
        else:
            raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder}")
        self.handles = {}
        self.where: dict[str, str] = {}
        for f in files:
            path = folder / f
            if not path.exists():
                raise CheckpointError(f"checkpoint shard {path} is missing")
            try:
                h = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
                raise CheckpointError(f"cannot read {path}: {e}") from None
            self.handles[f] = h
            for k in h.keys():
                self.where[k] = f

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[self.where[name]].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.handles[self.where[name]].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name} from {self.where[name]}: {e}") from None


def load_checkpoint(folder: str | Path, cfg: ModelConfig, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, progress: bool = True) -> ModelWeights:
    """Load a Hugging Face `cohere2_moe` checkpoint into our fused layout.

    Each destination tensor is allocated once on the target device and filled slice by slice from the
    memory-mapped file, so host memory stays near one copy of the weights.
    """
    folder = Path(folder)
    reader = _CheckpointReader(folder)
    expected = expected_shapes(cfg)
    present = reader.names()

    # Accept fused expert tensors too (transformers' in-memory layout written out by some tools).
    fused = {n for n in present if n.endswith(_FUSED_EXPERT_RE)}
    if fused:
        for i in cfg.moe_layers:
            p = f"model.layers.{i}.mlp.experts."
            if p + "gate_up_proj" in present:
                for e in range(cfg.num_experts):
                    for part in ("gate_proj", "up_proj", "down_proj"):
                        expected.pop(p + f"{e}.{part}.weight", None)
                I, H = cfg.moe_intermediate_size, cfg.hidden_size
                expected[p + "gate_up_proj"] = (cfg.num_experts, 2 * I, H)
                expected[p + "down_proj"] = (cfg.num_experts, H, I)
    # A tied checkpoint may still carry a copy of lm_head; ignore it.
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected) - ignorable)
    if missing:
        raise CheckpointError(f"checkpoint {folder} lacks tensor {missing[0]}" +
                              (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise CheckpointError(f"checkpoint {folder} has unexpected tensor {unexpected[0]}" +
                              (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for name, shape in expected.items():
        got = reader.shape(name)
        if got != shape:
            raise CheckpointError(f"tensor {name} has shape {list(got)}, expected {list(shape)}")

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(expected), desc=f"Loading {folder.name}", unit="tensor", leave=False)

    def take(name: str) -> torch.Tensor:
        t = reader.get(name).to(device=device, dtype=dtype)
        if bar is not None:
            bar.update(1)
        return t

    def fill(dst: torch.Tensor, name: str) -> None:
        dst.copy_(reader.get(name))
        if bar is not None:
            bar.update(1)

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device=device, dtype=dtype)

    H, Q, KV = cfg.hidden_size, cfg.q_size, cfg.kv_size
    embed = take("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else take("lm_head.weight")
    layers: list[LayerWeights] = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = empty(Q + 2 * KV, H)
        fill(qkv[:Q], p + "self_attn.q_proj.weight")
        fill(qkv[Q:Q + KV], p + "self_attn.k_proj.weight")
        fill(qkv[Q + KV:], p + "self_attn.v_proj.weight")
        lw = LayerWeights(norm_weight=take(p + "input_layernorm.weight"), qkv=qkv,
                          o=take(p + "self_attn.o_proj.weight"))
        if cfg.attention_bias:
            lw.qkv_bias = empty(Q + 2 * KV)
            fill(lw.qkv_bias[:Q], p + "self_attn.q_proj.bias")
            fill(lw.qkv_bias[Q:Q + KV], p + "self_attn.k_proj.bias")
            fill(lw.qkv_bias[Q + KV:], p + "self_attn.v_proj.bias")
            lw.o_bias = take(p + "self_attn.o_proj.bias")
        if cfg.is_moe(i):
            I, E = cfg.moe_intermediate_size, cfg.num_experts
            if p + "mlp.experts.gate_up_proj" in present:
                gate_up, down = take(p + "mlp.experts.gate_up_proj"), take(p + "mlp.experts.down_proj")
            else:
                gate_up, down = empty(E, 2 * I, H), empty(E, H, I)
                for e in range(E):
                    q = p + f"mlp.experts.{e}."
                    fill(gate_up[e, :I], q + "gate_proj.weight")
                    fill(gate_up[e, I:], q + "up_proj.weight")
                    fill(down[e], q + "down_proj.weight")
            shared = None
            if cfg.num_shared_experts:
                shared = _load_mlp(p + "mlp.shared_experts.", I * cfg.num_shared_experts, H, empty, fill, take)
            lw.moe = MoEWeights(router=take(p + "mlp.gate.weight"), experts_gate_up=gate_up,
                                experts_down=down, shared=shared)
        else:
            lw.dense = _load_mlp(p + "mlp.", cfg.dense_intermediate_size, H, empty, fill, take)
        layers.append(lw)
    weights = ModelWeights(embed=embed, final_norm=take("model.norm.weight"), lm_head=lm_head, layers=layers)
    if bar is not None:
        bar.close()
    return weights


def _load_mlp(prefix: str, inter: int, hidden: int, empty, fill, take) -> MLPWeights:
    gate_up = empty(2 * inter, hidden)
    fill(gate_up[:inter], prefix + "gate_proj.weight")
    fill(gate_up[inter:], prefix + "up_proj.weight")
    return MLPWeights(gate_up=gate_up, down=take(prefix + "down_proj.weight"))


# ---------------------------------------------------------------------------------------------------------------
# Random weights (benchmarks and GPU tests at real dimensions, no checkpoint needed)
# ---------------------------------------------------------------------------------------------------------------

def random_weights(cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                   seed: int = 0) -> ModelWeights:
    """Seeded random weights built directly on `device`.

    Matrices are N(0, 1/fan_in) so activations keep unit scale through 49 layers; norms are 1 +- 0.1 so a
    wrong norm weight shows up in a parity test. Deterministic for a given (seed, device).
    """
    on_meta = torch.device(device).type == "meta"      # shapes only (size accounting), no values
    gen = None if on_meta else torch.Generator(device=device).manual_seed(seed)

    def mat(*shape: int) -> torch.Tensor:
        t = torch.empty(shape, device=device, dtype=dtype)
        return t if on_meta else t.normal_(0.0, 1.0 / math.sqrt(shape[-1]), generator=gen)

    def norm() -> torch.Tensor:
        t = torch.empty(cfg.hidden_size, device=device, dtype=dtype)
        return t if on_meta else t.uniform_(0.9, 1.1, generator=gen)

    def bias(n: int) -> torch.Tensor:
        t = torch.empty(n, device=device, dtype=dtype)
        return t if on_meta else t.normal_(0.0, 0.02, generator=gen)

    H, Q, KV = cfg.hidden_size, cfg.q_size, cfg.kv_size
    embed = torch.empty(cfg.vocab_size, H, device=device, dtype=dtype)
    if not on_meta:
        embed.normal_(0.0, 1.0, generator=gen)
    lm_head = embed if cfg.tie_word_embeddings else mat(cfg.vocab_size, H)
    layers = []
    for i in range(cfg.num_layers):
        lw = LayerWeights(norm_weight=norm(), qkv=mat(Q + 2 * KV, H), o=mat(H, Q))
        if cfg.attention_bias:
            lw.qkv_bias, lw.o_bias = bias(Q + 2 * KV), bias(H)
        if cfg.is_moe(i):
            I, E = cfg.moe_intermediate_size, cfg.num_experts
            shared = None
            if cfg.num_shared_experts:
                Is = I * cfg.num_shared_experts
                shared = MLPWeights(gate_up=mat(2 * Is, H), down=mat(H, Is))
            lw.moe = MoEWeights(router=mat(E, H), experts_gate_up=mat(E, 2 * I, H), experts_down=mat(E, H, I),
                                shared=shared)
        else:
            I = cfg.dense_intermediate_size
            lw.dense = MLPWeights(gate_up=mat(2 * I, H), down=mat(H, I))
        layers.append(lw)
    return ModelWeights(embed=embed, final_norm=norm(), lm_head=lm_head, layers=layers)
