"""The megakernel's inner-loop microbenchmark: one engine (North Mini Code dims, random weights, synthetic KV), the
plan's runtime knobs swept in-process, ms/step per point.

    python benchmarks/megakernel_variants.py --points 1x8192,8x8192 \
        --variants "default split_tokens=1024 n_workers=96 oproj_first=1" --json OUT.json

Each variant is `default` or comma-separated KEY=INT overrides of the plan (keys: kernel/tuning.py TUNING_KEYS:
split_tokens, attn_stages, n_workers, oproj_first, qkv_by_head, batch_tiles, ...), applied on top of the defaults
(the plan's, then this card's row of kernel/tuning.py CARD_TUNING). The task lists are rebuilt for every variant.
Compile-time switches (kernel/build.py KERNEL_SWITCHES) are per process: run the script again with
$MEGAKERNEL_KERNEL_DEFINES, e.g. MEGAKERNEL_KERNEL_DEFINES=MK_ATTN_PAD=1. Prints the achieved bandwidth and % of the
roofline measured in the same run, as `megakernel bench` does; the full sweep stays `megakernel bench --sweep`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from megakernel.bench import PEAK_METHODS, BenchFailure, _abort_all, _run_point, measure_read_bandwidth, run_record
from megakernel.config import north_mini_code_config
from megakernel.engine.llm_engine import EngineArgs, LLMEngine
from megakernel.errors import OutOfKVBlocks, RequestError
from megakernel.kernel.tuning import TUNING_KEYS
from megakernel.model.weights import random_weights


def north_engine(max_context: int, steps: int) -> LLMEngine:
    """The engine every variant runs on: North Mini Code dims, random weights, the megakernel, room for max_context."""
    cfg = north_mini_code_config()
    weights = random_weights(cfg, torch.device("cuda"), torch.bfloat16, seed=0)
    return LLMEngine(EngineArgs(backend="megakernel", max_num_seqs=16, max_model_len=max_context + 8 * steps + 256,
                                enable_prefix_caching=False, progress=False), config=cfg, weights=weights)


def plan_knobs(be) -> dict[str, int]:
    """The backend's plan knobs now (its TUNING_KEYS values), as set_tuning takes them."""
    return {**{k: getattr(be.plan, k) for k in TUNING_KEYS if k != "batch_tiles"}, "batch_tiles": be.batch_tiles}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="1x8192,8x8192", help="BxCONTEXT list")
    ap.add_argument("--variants", default="default", help="space-separated variants: default or KEY=INT,KEY=INT")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--peak", choices=PEAK_METHODS, default="torch",
                    help="the roofline's peak read bandwidth (megakernel bench --peak)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    variants: list[dict[str, int]] = []
    for v in args.variants.split():
        kv = {} if v == "default" else dict(item.split("=") for item in v.split(","))
        bad = set(kv) - set(TUNING_KEYS)
        if bad:
            raise SystemExit(f"--variants: unknown keys {sorted(bad)} (known: {', '.join(TUNING_KEYS)})")
        variants.append({k: int(x) for k, x in kv.items()})
    engine = north_engine(max(c for _, c in points), args.steps)
    cfg, be = engine.config, engine.runner.decode_backend
    peak = measure_read_bandwidth(engine.device, method=args.peak) / 1e9
    print(f"peak read bandwidth {peak:.0f} GB/s; smem {be.smem} B; tiles {be.plan.gemv_tiles}", flush=True)
    rows = []
    defaults = plan_knobs(be)
    for B, ctx in points:
        too_big = ""                                       # the pool cannot hold this point's prompts together
        for var in variants:
            label = ",".join(f"{k}={x}" for k, x in var.items()) or "default"
            if too_big:                                    # (no variant changes the pool: skip the rest unfilled)
                rows.append(dict(batch_size=B, context=ctx, variant=label, skipped=too_big))
                continue
            try:
                be.set_tuning(**{**defaults, **var})       # rebuilds the plans; task lists are rebuilt
            except ValueError as e:                        # e.g. a combination that overflows shared memory
                print(f"b{B} ctx {ctx} {label}: skipped ({e})", flush=True)
                rows.append(dict(batch_size=B, context=ctx, variant=label, skipped=str(e)))
                continue
            t0 = time.perf_counter()
            try:
                p = _run_point(engine, cfg, B, ctx, args.steps, "synthetic", peak, f"v{len(rows)}-{B}-{ctx}")
            except BenchFailure as e:                      # the kernel refused or failed the step: say so
                print(f"b{B} ctx {ctx} {label}: FAILED ({e})", flush=True)
                rows.append(dict(batch_size=B, context=ctx, variant=label, failed=str(e)))
                continue
            except (RequestError, OutOfKVBlocks) as e:     # the point's prompts do not fit the KV pool (together)
                _abort_all(engine)
                too_big = str(e)
                print(f"b{B} ctx {ctx}: skipped, every variant ({e})", flush=True)
                rows.append(dict(batch_size=B, context=ctx, variant=label, skipped=too_big))
                continue
            rows.append(dict(batch_size=B, context=ctx, variant=label, **plan_knobs(be),
                             ms_per_step=p.ms_per_step, tokens_per_s=p.tokens_per_s, gb_per_s=p.gb_per_s,
                             roofline_pct=p.roofline_pct))
            print(f"b{B} ctx {ctx} {label}: {p.ms_per_step:.3f} ms/step, {p.tokens_per_s:.1f} tok/s, "
                  f"{p.gb_per_s:.0f} GB/s, {p.roofline_pct:.1f}% of the roofline ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    if args.json:
        import os

        doc = dict(**run_record(), kernel_defines=os.environ.get("MEGAKERNEL_KERNEL_DEFINES", ""),
                   peak_read_gb_per_s=peak, peak_method=args.peak, points=rows)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
