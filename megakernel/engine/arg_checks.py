"""EngineArgs checked before anything loads, so a bad value is one line naming the option, not a traceback (or a
server that starts and then hangs every request, as max_num_batched_tokens=0 did)."""

from __future__ import annotations

import torch

from megakernel.engine.loader import DTYPES
from megakernel.errors import ConfigError


def check_engine_args(args) -> None:
    """Values that are wrong whatever the model: sizes, device, dtype, backend."""
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"{name} must be at least 1 (got {getattr(args, name)})")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ConfigError(f"max_model_len must be at least 2 (a prompt token and a generated one); got "
                          f"{args.max_model_len}")
    if args.kv_cache_memory is not None and args.kv_cache_memory <= 0:
        raise ConfigError(f"kv_cache_memory must be positive (got {args.kv_cache_memory})")
    util = getattr(args, "gpu_memory_utilization", None)
    if util is not None and not 0 < util <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1] (got {util})")
    if isinstance(args.dtype, str) and args.dtype not in DTYPES and args.dtype != "auto":
        raise ConfigError(f"unsupported dtype {args.dtype!r}; choose one of auto, {', '.join(sorted(DTYPES))}")
    dev = args.device
    if dev is not None and dev != "auto":
        try:
            dev = torch.device(dev)
        except RuntimeError:
            raise ConfigError(f"unknown device {args.device!r}: use cpu, cuda or cuda:N") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {args.device!r} requested but this machine has no usable CUDA device")
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"unsupported device {args.device!r}: use cpu, cuda or cuda:N")
    from megakernel.engine.backends import choose_backend
    from megakernel.engine.loader import resolve_device

    choose_backend(args.backend, resolve_device(dev if dev not in (None, "auto") else None))


def check_model_len(args, max_position_embeddings: int) -> None:
    """max_model_len must fit the model's positions."""
    if args.max_model_len is not None and args.max_model_len > max_position_embeddings:
        raise ConfigError(f"max_model_len {args.max_model_len} is beyond this model's max_position_embeddings "
                          f"({max_position_embeddings})")
