"""Open a model folder: config, weights on the target device, tokenizer (if the folder has one)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from megakernel.config import ModelConfig
from megakernel.errors import CheckpointError
from megakernel.model.weights import ModelWeights, load_checkpoint

log = logging.getLogger("megakernel")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype, progress: bool = True
               ) -> tuple[ModelConfig, ModelWeights]:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"model folder {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"model path {path} is not a folder")
    cfg = ModelConfig.from_pretrained(path)
    weights = load_checkpoint(path, cfg, device=device, dtype=dtype, progress=progress)
    return cfg, weights


def load_tokenizer(path: str | Path | None):
    """transformers' AutoTokenizer from the checkpoint folder, or None when the folder has no tokenizer."""
    if path is None:
        return None
    path = Path(path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def generation_eos_ids(path: str | Path | None, cfg: ModelConfig, tokenizer) -> tuple[int, ...]:
    """End-of-sequence ids from config.json, generation_config.json and the tokenizer, merged."""
    import json

    ids = set(cfg.eos_token_ids)
    if path is not None and (Path(path) / "generation_config.json").exists():
        gen = json.loads((Path(path) / "generation_config.json").read_text())
        eos = gen.get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
