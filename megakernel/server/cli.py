"""`megakernel serve`: build the engine, wrap it in the OpenAI-compatible app, run uvicorn."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re

# Fail at import (so `megakernel serve` can say which extra to install) rather than after loading the model.
import fastapi  # noqa: F401
import prometheus_client  # noqa: F401
import uvicorn  # noqa: F401

log = logging.getLogger("megakernel.server")


def _bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 4G, 1073741824)")
    unit = (m.group(2) or "").rstrip("b").rstrip("i")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit])


def _blocks(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a block count list: {text!r} (e.g. 64 or 64,32)") from None


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megakernel serve", description="OpenAI-compatible HTTP server")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients pass as `model` (default: the model folder's name)")
    p.add_argument("--api-key", default=os.environ.get("MEGAKERNEL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every /v1 route (env MEGAKERNEL_API_KEY)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "megakernel"], help="decode backend")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--max-batch-size", type=int, default=16, help="most sequences in the running batch")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + completion)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens per step (decodes plus prefill chunk): bounds how long a prefill stalls streams")
    p.add_argument("--kv-cache-memory", type=_bytes, default=None,
                   help="KV cache budget, e.g. 4G (default: 1 GiB on CPU, 85%% of free memory on GPU)")
    p.add_argument("--num-kv-blocks", type=_blocks, default=None,
                   help="exact KV blocks per group (full[,sliding]); overrides --kv-cache-memory")
    p.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def build_engine(args: argparse.Namespace):
    from megakernel.engine.llm_engine import EngineArgs, LLMEngine

    num_blocks = args.num_kv_blocks
    eargs = EngineArgs(model=args.model, device=args.device, dtype=args.dtype, backend=args.backend,
                       max_num_seqs=args.max_batch_size, max_model_len=args.max_model_len,
                       max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                       kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=not args.no_prefix_caching,
                       seed=args.seed, progress=False)
    if num_blocks is not None:
        from megakernel.config import ModelConfig
        from megakernel.default_model import resolve_model_path
        from megakernel.kv.cache import KVLayout

        groups = KVLayout.for_model(ModelConfig.from_pretrained(resolve_model_path(args.model)), args.block_size).groups
        if len(num_blocks) == 1:
            num_blocks = num_blocks * len(groups)
        if len(num_blocks) != len(groups):
            raise SystemExit(f"--num-kv-blocks: this model has {len(groups)} KV groups "
                             f"({', '.join(g.name for g in groups)}); give that many counts")
        eargs.num_kv_blocks = num_blocks
    engine = LLMEngine(eargs)
    clamp_max_model_len(engine)
    return engine


def clamp_max_model_len(engine) -> int:
    """Lower max_model_len to what one sequence can hold in the KV pools (so every admitted request fits)."""
    layout = engine.blocks.layout
    bs = layout.block_size
    chunk = engine.scheduler.max_num_batched_tokens
    cap = engine.max_model_len
    for g, pool in enumerate(engine.blocks.pools):
        w = layout.groups[g].window
        if w is None:
            cap = min(cap, pool.num_blocks * bs)
        elif pool.num_blocks < math.ceil((w - 1 + chunk) / bs) + 1:
            cap = min(cap, max(0, (pool.num_blocks - 1) * bs))
    if cap < engine.max_model_len:
        log.warning("megakernel: the KV cache holds at most %d tokens per sequence; max_model_len lowered from "
                    "%d to %d", cap, engine.max_model_len, cap)
        engine.max_model_len = cap
    if cap < 2:
        raise SystemExit("the KV cache is too small to hold even one token per sequence")
    return cap


def build_server(args: argparse.Namespace, engine=None):
    from megakernel.server.app import create_app
    from megakernel.server.async_engine import AsyncEngine
    from megakernel.server.metrics import ServerMetrics

    engine = engine or build_engine(args)
    names = args.served_model_name or [_default_name(engine, args.model)]
    metrics = ServerMetrics(names[0])
    return create_app(AsyncEngine(engine, metrics), names, api_key=args.api_key, metrics=metrics)


def _default_name(engine, model) -> str:
    from pathlib import Path

    path = getattr(engine, "model_path", None) or model
    return Path(path).name if path else "megakernel"


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("megakernel").setLevel(level)
    app = build_server(args)
    log.info("megakernel: serving %s on http://%s:%d/v1", app.state.mk.cfg.served_model_names, args.host,
             args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
