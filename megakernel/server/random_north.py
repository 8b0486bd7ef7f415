"""`megakernel serve --random-north`: serve North Mini Code's dimensions with random weights (no checkpoint, no
tokenizer: prompts are token ids on /v1/completions). For benchmarks on a GPU (`megakernel bench serve`)."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from megakernel.errors import ConfigError

log = logging.getLogger("megakernel.server")


def random_north_model(args: argparse.Namespace) -> dict[str, Any]:
    """The `config=`/`weights=` keywords of LLMEngine for --random-north ({} without it): North Mini Code's config
    and seeded random bf16 weights, built on the GPU (61 GB: a CPU run is refused with a one-line error)."""
    if not getattr(args, "random_north", False):
        return {}
    import torch

    if args.model is not None:
        raise ConfigError(f"--random-north builds its own weights: drop the model ({args.model})")
    if args.num_kv_blocks is not None:
        raise ConfigError("--random-north: give the KV budget with --kv-cache-memory or --gpu-memory-utilization, "
                          "not --num-kv-blocks")
    if not torch.cuda.is_available() or str(args.device or "cuda").startswith("cpu"):
        raise ConfigError("--random-north builds North Mini Code's 61 GB of weights on a CUDA GPU; this machine has "
                          "none (serve a checkpoint with --model instead)")
    from megakernel.config import north_mini_code_config
    from megakernel.engine.loader import resolve_dtype
    from megakernel.model.weights import random_weights

    device = torch.device(args.device or "cuda")
    dtype = resolve_dtype(None if args.dtype in (None, "auto") else args.dtype, device)
    cfg = north_mini_code_config()
    t0 = time.monotonic()
    weights = random_weights(cfg, device, dtype, seed=0)       # as `megakernel bench --random-north`
    log.info("random North Mini Code weights (%s) built in %.1f s", dtype, time.monotonic() - t0)
    return {"config": cfg, "weights": weights}
