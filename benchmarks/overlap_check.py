"""Does the device idle between decode steps? Engine steps, pipelined vs synchronous, under the CUDA profiler.

North Mini Code dimensions with random bf16 weights, megakernel decode, one batch and context. For each mode:
- ms per engine step (host wall clock, steady state),
- the GPU gap between one step's megakernel and the next one's (median and 90th percentile),
- the share of the wall time during which some kernel or copy runs on the GPU,
- how often per step the host called a CUDA function that waits for the device.

    python benchmarks/overlap_check.py --batch-size 1 --context 8192 --steps 64 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from megakernel import SamplingParams
from megakernel.config import north_mini_code_config
from megakernel.engine.llm_engine import EngineArgs, LLMEngine
from megakernel.model.weights import random_weights


SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaHostAlloc", "cudaFreeHost"}


def busy_union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def measure(weights, cfg, B: int, ctx: int, steps: int, pipelined: bool) -> dict:
    engine = LLMEngine(EngineArgs(device="cuda", backend="megakernel", max_num_seqs=B, max_model_len=ctx + 2 * steps + 16,
                                  max_num_batched_tokens=2048, async_scheduling=pipelined, progress=False),
                       config=cfg, weights=weights)
    g = torch.Generator().manual_seed(0)
    for i in range(B):
        engine.add_request(f"r{i}", torch.randint(3, cfg.vocab_size, (ctx,), generator=g).tolist(),
                           SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True))
    while any(s.num_computed < len(s.prompt_token_ids) for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    for _ in range(4):
        engine.step()                                          # warm-up decode steps
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    mk = sorted((e.time_range.start, e.time_range.end) for e in gpu if "mk_decode" in e.name)
    gaps = sorted(b[0] - a[1] for a, b in zip(mk, mk[1:]))
    lo, hi = mk[1][0], mk[-1][1]                             # from the 2nd step's kernel to the last one's end
    inside = [(max(a, lo), min(b, hi)) for a, b in ((e.time_range.start, e.time_range.end) for e in gpu)
              if b > lo and a < hi]
    busy = busy_union(inside) / (hi - lo)
    kernel_us = sorted(b - a for a, b in mk)
    # host calls that wait for the device: stream/device-wide waits stall the pipeline, event waits need not
    waits = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name in SYNC_CALLS:
            waits[e.name] = waits.get(e.name, 0) + 1
    while engine.has_unfinished_requests():
        for rid in list(engine.requests):
            engine.abort_request(rid)
        engine.step()
    engine.drain()
    del engine
    torch.cuda.empty_cache()
    return dict(pipelined=pipelined, B=B, ctx=ctx, steps=steps, step_ms=round(step_ms, 3),
                kernel_ms_median=round(kernel_us[len(kernel_us) // 2] / 1e3, 3),
                gap_us_median=round(gaps[len(gaps) // 2], 1), gap_us_p90=round(gaps[int(0.9 * (len(gaps) - 1))], 1),
                gpu_busy=round(busy, 4), n_kernels=len(mk),
                host_waits_per_step={k: round(v / steps, 2) for k, v in sorted(waits.items())})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    cfg = north_mini_code_config()
    w = random_weights(cfg, "cuda", torch.bfloat16, seed=0)
    out = [measure(w, cfg, args.batch_size, args.context, args.steps, p) for p in (True, False)]
    for r in out:
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": out}, f, indent=1)


if __name__ == "__main__":
    main()
