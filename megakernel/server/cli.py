"""`megakernel serve`: build the engine, wrap it in the OpenAI-compatible app, run uvicorn."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

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


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r} (0..65535; 0 picks a free one)")
    return port


def _at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo} (got {v})")
        return v
    return parse


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1] (got {text!r})")
    return v


def _origins(values: list[str]) -> list[str]:
    """--allowed-origins as vLLM takes it ('["http://a", "http://b"]') or as plain words."""
    if len(values) == 1 and values[0].strip().startswith("["):
        try:
            parsed = json.loads(values[0])
        except json.JSONDecodeError as e:
            raise SystemExit(f"--allowed-origins: not a JSON list: {e}") from None
        return [str(v) for v in parsed]
    return list(values)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Show each option's default, unless its help already says it (or there is none to show)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def make_parser() -> argparse.ArgumentParser:
    from megakernel import __version__
    from megakernel.engine.loader import DTYPES
    from megakernel.server.middleware import MAX_BODY_BYTES

    p = argparse.ArgumentParser(prog="megakernel serve", description="OpenAI-compatible HTTP server",
                                formatter_class=_Help)
    p.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                   help="checkpoint folder (as `vllm serve MODEL`; default: the embedded north-nano)")
    p.add_argument("--model", default=None, help="checkpoint folder (same as MODEL)")
    p.add_argument("--random-north", action="store_true",
                   help="GPU benchmarks: North Mini Code with random weights (no checkpoint, no tokenizer)")
    p.add_argument("--version", action="version", version=f"megakernel {__version__}")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8000, help="TCP port")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients pass as `model` (default: the model folder's name)")
    p.add_argument("--api-key", default=os.environ.get("MEGAKERNEL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every /v1 route (env MEGAKERNEL_API_KEY)")
    p.add_argument("--allowed-origins", nargs="+", default=None,
                   help="CORS: origins browsers may call from, e.g. '[\"*\"]' or http://localhost:3000")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file, or the template text) instead of the checkpoint's")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "megakernel", "graph"],
                   help="decode backend: auto = the megakernel on sm_90, CUDA graphs on other GPUs, torch on CPU")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                   help="weights and activations (auto: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--max-num-seqs", "--max-batch-size", dest="max_num_seqs", type=_at_least(1), default=16,
                   help="most sequences in the running batch")
    p.add_argument("--max-model-len", type=_at_least(2), default=None,
                   help="context length, prompt + completion (default: the model's, at most 32768)")
    p.add_argument("--max-num-batched-tokens", type=_at_least(1), default=None,
                   help="tokens per step (decodes plus prefill chunk): larger chunks prefill faster, smaller ones "
                        "stall running streams less (default: 8192 with the library prefill on a GPU, else 512)")
    p.add_argument("--prefill-with-decodes", type=_at_least(1), default=None,
                   help="prefill tokens of a step that also runs decodes: smaller keeps streams moving while a long "
                        "prompt prefills (default: 2048 with the library prefill on a GPU, else no separate cap)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                   help="GPU: the fraction of GPU memory this server may use; the KV cache gets what the weights "
                        "leave of it (default: 85%% of the memory free after loading)")
    p.add_argument("--kv-cache-memory", type=_bytes, default=None,
                   help="KV cache budget, e.g. 4G (default: 1 GiB on CPU; overrides --gpu-memory-utilization)")
    p.add_argument("--num-kv-blocks", type=_blocks, default=None,
                   help="exact KV blocks per group (full[,sliding]); overrides --kv-cache-memory")
    p.add_argument("--block-size", type=_at_least(1), default=64, help="tokens per KV block")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    p.add_argument("--max-request-body", type=_bytes, default=MAX_BODY_BYTES,
                   help="larger request bodies get a 413")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between throughput/queue log lines (0: none)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def _chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise SystemExit(f"--chat-template: {value!r} is neither a file nor a template")
    return value


def build_engine(args: argparse.Namespace):
    from megakernel.engine.arg_checks import check_engine_args
    from megakernel.engine.llm_engine import EngineArgs, LLMEngine

    num_blocks = args.num_kv_blocks
    eargs = EngineArgs(model=args.model, device=args.device, dtype=args.dtype, backend=args.backend,
                       max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                       max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                       prefill_with_decodes=args.prefill_with_decodes,
                       kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=not args.no_prefix_caching,
                       seed=args.seed, progress=sys.stderr.isatty(),
                       gpu_memory_utilization=args.gpu_memory_utilization, fit_max_model_len_to_kv=True)
    check_engine_args(eargs)          # before the (possibly minutes-long) weight loading
    from megakernel.server.random_north import random_north_model

    model_kwargs = random_north_model(args)       # {} unless --random-north
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
    t0 = time.monotonic()
    what = args.model or ("North Mini Code (random weights)" if model_kwargs else "the embedded model")
    log.info("loading %s (device %s, dtype %s)...", what, args.device or "auto", args.dtype)
    engine = LLMEngine(eargs, **model_kwargs)
    log.info("model loaded in %.1f s", time.monotonic() - t0)
    return engine


def build_server(args: argparse.Namespace, engine=None):
    from megakernel.server.app import create_app
    from megakernel.server.async_engine import AsyncEngine
    from megakernel.server.metrics import ServerMetrics

    template = _chat_template(args.chat_template)
    origins = _origins(args.allowed_origins) if args.allowed_origins else None
    engine = engine or build_engine(args)
    names = args.served_model_name or [_default_name(engine, args.model)]
    metrics = ServerMetrics(names[0])
    from megakernel.server.step_gaps import watch_step_gaps

    watch_step_gaps(engine, metrics.registry)        # engine idle share on /metrics
    return create_app(AsyncEngine(engine, metrics, log_interval=args.log_stats_interval), names,
                      api_key=args.api_key, metrics=metrics, chat_template=template, allowed_origins=origins,
                      max_body_bytes=args.max_request_body)


def _default_name(engine, model) -> str:
    from pathlib import Path

    path = getattr(engine, "model_path", None) or model
    return Path(path).name if path else "megakernel"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = make_parser()
    args = p.parse_args(argv)
    if args.model_pos is not None and args.model is not None and args.model_pos != args.model:
        p.error(f"the model is given twice: {args.model_pos!r} and --model {args.model!r}")
    args.model = args.model or args.model_pos
    return args


class _Server(uvicorn.Server):
    """uvicorn, but a SIGTERM or Ctrl-C first ends every open request (streams get an error event and [DONE])
    instead of waiting for the graceful-shutdown timeout and cutting them."""

    def __init__(self, config: uvicorn.Config, engine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            log.info("shutting down: ending %d open request(s)", len(self.engine._sinks))
            self.engine.shutdown(timeout=0)
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("megakernel").setLevel(level)
    app = build_server(args)
    # The model, tokenizer and app are built: move what they allocated out of the collector's reach. A collection of
    # the oldest generation walks every tracked object (~230K here after loading the embedded model: 60-110 ms on a
    # 2-core machine, under the GIL, so every stream and /health waits); frozen objects are skipped (vLLM does the same)
    gc.collect()
    gc.freeze()
    log.info("serving %s on http://%s:%d/v1", app.state.mk.cfg.served_model_names, args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    server = _Server(config, app.state.mk.engine)
    try:
        server.run()
    except KeyboardInterrupt:      # a second Ctrl-C: quit without a traceback
        return 130
    return 0
