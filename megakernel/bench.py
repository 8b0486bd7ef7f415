"""`megakernel bench`: decode throughput through the engine, with achieved bandwidth and % of the roofline.

Bytes per step count what a decode step must read at least once: every attention/dense/router weight, the experts
actually routed in that step (distinct per layer, recorded from the step itself), the LM head, and the live KV
of every row (sliding layers read at most a window). The roofline is that over the peak read bandwidth measured
in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch

from megakernel.config import ModelConfig


def weight_bytes_per_step(cfg: ModelConfig, distinct_experts: list[int], elt: int) -> int:
    """Bytes of weights one decode step reads; distinct_experts[j] = experts routed in the j-th MoE layer."""
    H, Q, KV = cfg.hidden_size, cfg.q_size, cfg.kv_size
    per_expert = 3 * H * cfg.moe_intermediate_size
    total = cfg.vocab_size * H                               # LM head (tied or not: read once)
    moe_j = 0
    for i in range(cfg.num_layers):
        total += (Q + 2 * KV) * H + H * Q + H               # qkv, o, norm
        if cfg.is_moe(i):
            total += cfg.num_experts * H + distinct_experts[moe_j] * per_expert
            total += 3 * H * cfg.moe_intermediate_size * cfg.num_shared_experts
            moe_j += 1
        else:
            total += 3 * H * cfg.dense_intermediate_size
    return total * elt


def kv_bytes_per_step(cfg: ModelConfig, context_lens: list[int], elt: int) -> int:
    total = 0
    for i in range(cfg.num_layers):
        w = cfg.window_for(i)
        total += sum(min(n, w) if w else n for n in context_lens)
    return total * 2 * cfg.kv_size * elt


def measure_read_bandwidth(device: torch.device, gib: float = 4.0) -> float:
    """Best streaming-read rate (bytes/s) of a large reduction: the roofline's denominator."""
    x = torch.ones(int(gib * (1 << 30)) // 2, dtype=torch.bfloat16, device=device)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        x.sum()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * x.element_size() / best


def run_bench(args: argparse.Namespace) -> int:
    from megakernel import SamplingParams
    from megakernel.config import north_mini_code_config
    from megakernel.engine.llm_engine import EngineArgs, LLMEngine
    from megakernel.model.cohere2_moe import ForwardTrace
    from megakernel.model.weights import random_weights

    B, ctx, steps = args.batch_size, args.context, args.steps
    common = dict(device=args.device, dtype=args.dtype, backend=args.backend, max_num_seqs=B,
                  max_model_len=max(ctx + steps + 8, args.max_model_len or 0), max_num_batched_tokens=2048,
                  async_scheduling=not args.sync_steps)
    if args.random_north:
        cfg = north_mini_code_config()
        dev = torch.device(args.device or "cuda")
        engine = LLMEngine(EngineArgs(**common), config=cfg,
                           weights=random_weights(cfg, dev, torch.bfloat16, seed=0))
    else:
        engine = LLMEngine(EngineArgs(model=args.model, **common))
        cfg = engine.config
    g = torch.Generator().manual_seed(0)
    for i in range(B):
        engine.add_request(f"b{i}", torch.randint(0, cfg.vocab_size, (ctx,), generator=g).tolist(),
                           SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    while any(len(s.output_token_ids) == 0 for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()                                        # prefill (and the first token)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    engine.step()                                            # warm-up decode step
    engine.runner.trace = trace = ForwardTrace()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    elapsed = time.perf_counter() - t0
    engine.runner.trace = None
    n_moe = len(cfg.moe_layers)
    distinct = [0] * n_moe
    for j, ids in enumerate(trace.experts):
        distinct[j % n_moe] += int(torch.unique(ids).numel())
    distinct = [d / steps for d in distinct]
    elt = engine.model.w.embed.element_size()
    lens = [ctx + 1 + steps // 2] * B
    step_bytes = weight_bytes_per_step(cfg, distinct, elt) + kv_bytes_per_step(cfg, lens, elt)
    step_s = elapsed / steps
    gbps = step_bytes / step_s / 1e9
    mode = "synchronous steps" if args.sync_steps else "pipelined steps"
    print(f"backend {engine.runner.backend_name} ({mode}), batch {B}, context {ctx}: {step_s * 1e3:.2f} ms/step, "
          f"{B / step_s:.1f} tok/s, {step_bytes / 1e9:.2f} GB/step read, {gbps:.0f} GB/s achieved")
    if engine.device.type == "cuda":
        peak = measure_read_bandwidth(engine.device) / 1e9
        print(f"peak read bandwidth {peak:.0f} GB/s measured; {100 * gbps / peak:.1f}% of the roofline "
              f"(roofline {peak * 1e9 / step_bytes * B:.0f} tok/s)")
    while engine.has_unfinished_requests():
        engine.step()
    return 0
