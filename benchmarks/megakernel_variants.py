"""The megakernel's inner-loop microbenchmark: one engine (North Mini Code dims, random weights, synthetic KV), the
plan's runtime knobs (attention split size, attention ring stages) swept in-process, ms/step per point.

    python benchmarks/megakernel_variants.py --points 1x8192,8x8192 --variants 512/2,512/4,256/4,128/4 --json OUT.json

Each variant is `split_tokens/attn_stages`. The task lists are rebuilt for every variant (the task cache is keyed by
the split size; the stage count is a kernel parameter). Prints the achieved bandwidth and % of the roofline measured
in the same run, as `megakernel bench` does; the full sweep stays `megakernel bench --sweep`.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from megakernel.bench import _git_commit, _run_point, measure_read_bandwidth
from megakernel.config import north_mini_code_config
from megakernel.engine.llm_engine import EngineArgs, LLMEngine
from megakernel.model.weights import random_weights


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="1x8192,8x8192", help="BxCONTEXT list")
    ap.add_argument("--variants", default="512/2,512/4,256/4,128/4", help="split_tokens/attn_stages list")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    variants = [tuple(int(x) for x in v.split("/")) for v in args.variants.split(",")]
    cfg = north_mini_code_config()
    weights = random_weights(cfg, torch.device("cuda"), torch.bfloat16, seed=0)
    max_len = max(c for _, c in points) + 8 * args.steps + 256
    engine = LLMEngine(EngineArgs(backend="megakernel", max_num_seqs=16, max_model_len=max_len,
                                  enable_prefix_caching=False, progress=False), config=cfg, weights=weights)
    be = engine.runner.decode_backend
    peak = measure_read_bandwidth(engine.device) / 1e9
    print(f"peak read bandwidth {peak:.0f} GB/s; smem {be.smem} B; tiles {be.plan.gemv_tiles}", flush=True)
    rows = []
    for B, ctx in points:
        for split, stages in variants:
            be.plan.split_tokens, be.plan.attn_stages = split, stages
            be._tasks.clear()
            t0 = time.perf_counter()
            p = _run_point(engine, cfg, B, ctx, args.steps, "synthetic", peak, f"v{split}-{stages}-{B}-{ctx}")
            rows.append(dict(batch_size=B, context=ctx, split_tokens=split, attn_stages=stages,
                             ms_per_step=p.ms_per_step, tokens_per_s=p.tokens_per_s, gb_per_s=p.gb_per_s,
                             roofline_pct=p.roofline_pct))
            print(f"b{B} ctx {ctx} split {split} stages {stages}: {p.ms_per_step:.3f} ms/step, "
                  f"{p.tokens_per_s:.1f} tok/s, {p.gb_per_s:.0f} GB/s, {p.roofline_pct:.1f}% of the roofline "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.json:
        doc = dict(commit=_git_commit(), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   gpu=torch.cuda.get_device_name(), peak_read_gb_per_s=peak, command=" ".join(__import__("sys").argv),
                   points=rows)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
