"""`megakernel bench`: decode throughput through the engine, with achieved bandwidth and % of the roofline.

Bytes per step count what a decode step must read at least once: every attention/dense/router weight, the experts
actually routed in that step (distinct per layer, recorded from the run), the LM head, and the live KV of every
row (sliding layers read at most a window). The roofline is that over the peak read bandwidth measured in the same
run. Timed steps run without recording anything; the routed experts come from a few extra recorded steps.

The KV cache of each point is filled synthetically by default (random K/V written straight into the sequences'
pages, as the published megakernel's own benchmark does): only the last prompt token runs through the model, so a
128K-context point does not wait minutes for a prefill. `--kv-fill prefill` prefills for real.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from megakernel.config import ModelConfig
from megakernel.errors import OutOfKVBlocks, RequestError
from megakernel.kernel.tuning import card_switches, card_tuning

# The standard sweep: batch 1 over context, then batch over 8K context.
SWEEP = [(1, 1024), (1, 8192), (1, 32768), (1, 131072), (1, 262144),
         (2, 8192), (4, 8192), (8, 8192), (16, 8192)]


def weight_bytes_per_step(cfg: ModelConfig, distinct_experts: list[float], elt: int) -> int:
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
    return int(total * elt)


def kv_bytes_per_step(cfg: ModelConfig, context_lens: list[int], elt: int) -> int:
    total = 0
    for i in range(cfg.num_layers):
        w = cfg.window_for(i)
        total += sum(min(n, w) if w else n for n in context_lens)
    return total * 2 * cfg.kv_size * elt


PEAK_METHODS = ("torch", "bulk", "best")


def measure_read_bandwidths(device: torch.device, method: str = "torch", gib: float = 4.0) -> dict[str, float]:
    """Best streaming-read rates (bytes/s) over `gib` GiB, by method: "torch", a reduction; "bulk", every SM's bulk
    copies (kernel/peak.py, sm_90 only; the copies the megakernel streams with, which read faster); "best", both where
    the bulk copies can run. The roofline's denominator is the largest."""
    if method not in PEAK_METHODS:
        raise ValueError(f"peak method {method!r}: want one of {', '.join(PEAK_METHODS)}")
    x = torch.ones(int(gib * (1 << 30)) // 2, dtype=torch.bfloat16, device=device)
    out: dict[str, float] = {}
    if method in ("torch", "best"):
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            x.sum()
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        out["torch"] = x.numel() * x.element_size() / best
    if method in ("bulk", "best"):
        from megakernel.kernel import peak

        if peak.available(device):
            out["bulk"] = peak.bulk_read_bandwidth(x)
        elif method == "bulk":
            raise BenchFailure("--peak bulk needs an sm_90 GPU and nvcc")
    return out


def measure_read_bandwidth(device: torch.device, gib: float = 4.0, method: str = "torch") -> float:
    """The roofline's denominator (bytes/s): the best of measure_read_bandwidths' rates."""
    return max(measure_read_bandwidths(device, method, gib).values())


@dataclass
class Point:
    backend: str
    batch_size: int
    context: int
    steps: int
    ms_per_step: float
    tokens_per_s: float
    bytes_per_step: int
    gb_per_s: float
    roofline_pct: float | None
    roofline_tokens_per_s: float | None
    kv_fill: str


def fill_kv_synthetic(engine, seq, n_tokens: int, gen: torch.Generator) -> None:
    """Back positions [0, n_tokens) of `seq` with blocks of random K/V, as if they had been prefilled (sliding groups
    only keep the window the next query sees); the sequence stays queued with n_tokens computed."""
    from megakernel.kv.block_manager import FREED

    layout, bs = engine.cache.layout, engine.cache.layout.block_size
    for g, group in enumerate(layout.groups):
        if group.window is not None:
            seq.blocks.tables[g].extend([FREED] * (engine.blocks.first_needed_position(g, n_tokens) // bs))
    engine.blocks.prepare(seq.blocks, n_tokens, n_tokens)
    for g, table in enumerate(seq.blocks.tables):
        ids = [b for b in table if b != FREED]
        kv = engine.cache.kv[g]
        for i in range(0, len(ids), 256):
            idx = torch.tensor(ids[i:i + 256], device=kv.device)
            shape = (kv.shape[0], len(idx)) + tuple(kv.shape[2:])
            kv[:, idx] = torch.randn(shape, generator=gen, device=kv.device, dtype=torch.float32).to(kv.dtype)
    seq.num_computed = n_tokens


def _print_kernel_profile(engine, label: str, steps: int = 5) -> None:
    """GPU time per decode step by kernel (torch profiler over a few engine steps), largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name if len(e.name) < 60 else e.name[:57] + "..."
            t, n = rows.get(name, (0.0, 0))
            rows[name] = (t + e.device_time, n + 1)
    total = sum(t for t, _ in rows.values())
    print(f"GPU time by kernel, {label}: {total / steps / 1e3:.3f} ms per step")
    for name, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"  {t / steps / 1e3:8.3f} ms {n / steps:7.1f}x  {name}")


def _trace_step(engine, path: str, normal_step_s: float, meta: dict, n_profiled: int = 8) -> None:
    """Profile decode steps on the megakernel's profiling build: time `n_profiled` of them against the normal
    build's figure, then write one step's Chrome trace to `path`, its PNG and summary JSON beside it, and print the
    summary."""
    from megakernel.kernel import timeline as T
    from megakernel.kernel.backend import MegakernelBackend

    be = engine.runner.decode_backend
    if not isinstance(be, MegakernelBackend):
        print(f"--trace: the {be.name} backend has no SM timeline (the megakernel has)")
        return
    sync = torch.cuda.synchronize
    engine.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(n_profiled):
        be.profile_next_step()
        engine.step()
    sync()
    prof_s = (time.perf_counter() - t0) / n_profiled
    engine.step()                             # reads back the last profiled launch (its records arrive then)
    raw = be.last_profile
    raw.meta.update(meta)
    tl = T.to_timeline(raw)
    bad = T.check_invariants(raw, tl)
    s = T.summarize(tl)
    s.update(normal_ms_per_step=normal_step_s * 1e3, profiled_step_span_ms=tl.step_ns / 1e6,
             profiled_engine_ms_per_step=prof_s * 1e3, invariant_violations=bad)
    stem = path[:-8] if path.endswith(".json.gz") else path.rsplit(".", 1)[0]
    # the summary and the raw records first: the trace and the plot of a large step take minutes to write
    Path(stem + ".summary.json").write_text(json.dumps({**run_record(), **s}, indent=1) + "\n")
    print(T.format_summary(s), flush=True)
    print(f"normal build {normal_step_s * 1e3:.2f} ms/step through the engine; the profiled step itself spans "
          f"{tl.step_ns / 1e6:.2f} ms (its own stamps); a profiled engine step takes {prof_s * 1e3:.0f} ms with the "
          f"records' read-back (same run); invariants: {'ok' if not bad else bad}")
    T.save_raw(raw, stem + ".npz")
    if path.endswith(".npz"):                # the records and the summary only (the trace: timeline.py redraws)
        print(f"wrote {stem}.summary.json, {stem}.npz")
        return
    T.write_trace(tl, path)
    T.plot_timeline(tl, stem + ".png", title=f"megakernel decode step, batch {meta['batch']}, context "
                    f"{meta['context']}: {tl.step_ns / 1e3:.0f} us (profiling build)")
    print(f"wrote {path}, {stem}.png, {stem}.summary.json, {stem}.npz")


class BenchFailure(RuntimeError):
    """A benchmark point's requests failed (the engine failed them and went on): its timing would be meaningless."""


def _checked_step(engine, tag: str) -> None:
    """engine.step(), raising BenchFailure if it finished a request of this point with an error (the engine fails
    the requests of a refused or failed decode launch and keeps serving; a benchmark must not time what follows)."""
    for out in engine.step():
        if out.request_id.startswith(f"{tag}-b") and out.error:
            _abort_all(engine)
            raise BenchFailure(f"{tag}: request {out.request_id} failed: {out.error}")


def _abort_all(engine) -> None:
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.drain()


def _run_point(engine, cfg: ModelConfig, B: int, ctx: int, steps: int, kv_fill: str, peak: float | None,
               tag: str, kernels: bool = False, trace_path: str | None = None) -> Point:
    from megakernel import SamplingParams
    from megakernel.model.cohere2_moe import ForwardTrace

    g = torch.Generator().manual_seed(ctx * 131 + B)
    dev_gen = torch.Generator(device=engine.device).manual_seed(ctx + B)
    total = steps + 2 + 3 + (5 if kernels else 0) + (10 if trace_path else 0) + 8   # warm-up, recorded, profiled
    for i in range(B):
        rid = f"{tag}-b{i}"
        engine.add_request(rid, torch.randint(0, cfg.vocab_size, (ctx,), generator=g).tolist(),
                           SamplingParams(temperature=0, max_tokens=total, ignore_eos=True))
        if kv_fill == "synthetic":
            fill_kv_synthetic(engine, engine.requests[rid].seqs[0], ctx - 1, dev_gen)
    sched = engine.scheduler
    rids = [f"{tag}-b{i}" for i in range(B)]
    while any(len(s.output_token_ids) == 0 for s in sched.running + list(sched.waiting)):
        _checked_step(engine, tag)                           # prefill (or its last token) and the first token
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    for _ in range(2):
        _checked_step(engine, tag)                           # warm-up decode steps
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    step_s = (time.perf_counter() - t0) / steps
    _checked_step(engine, tag)                               # (resolves the last timed step: a failure in the
                                                             # timed steps shows here or in `alive` below)
    alive = [r for r in rids if r in engine.requests and not engine.requests[r].seqs[0].finished]
    if len(alive) != B:
        _abort_all(engine)
        raise BenchFailure(f"{tag}: {B - len(alive)} of {B} requests ended during the timed steps; the figure "
                           "would time empty steps")
    if kernels:
        _print_kernel_profile(engine, f"{engine.runner.backend_name} batch {B} context {ctx}")
    if trace_path:
        _trace_step(engine, trace_path, step_s, dict(batch=B, context=ctx))
    engine.runner.trace = trace = ForwardTrace()             # a few more steps record the experts they route to
    n_rec = 3
    for _ in range(n_rec):
        engine.step()
    engine.runner.trace = None
    n_moe = len(cfg.moe_layers)
    distinct = [0.0] * n_moe
    for j, ids in enumerate(trace.experts):
        distinct[j % n_moe] += int(torch.unique(ids).numel()) / n_rec
    _abort_all(engine)
    elt = engine.model.w.embed.element_size()
    step_bytes = weight_bytes_per_step(cfg, distinct, elt) + kv_bytes_per_step(cfg, [ctx + steps // 2] * B, elt)
    gbps = step_bytes / step_s / 1e9
    return Point(engine.runner.backend_name, B, ctx, steps, step_s * 1e3, B / step_s, step_bytes, gbps,
                 100 * gbps / peak if peak else None, peak * 1e9 / step_bytes * B if peak else None, kv_fill)


def _points(args: argparse.Namespace) -> list[tuple[int, int]]:
    if args.sweep:
        return [p for p in SWEEP if p[1] <= args.max_context]
    return [(b, c) for b in args.batch_size for c in args.context]


def _git_commit() -> str:
    """The checkout's commit ($MEGAKERNEL_COMMIT where the tree runs without its .git, as on the device), "-dirty"
    when tracked files differ from it. Only this checkout's own repository counts: a copy of the tree inside another
    repository says "unknown", not that repository's commit."""
    if os.environ.get("MEGAKERNEL_COMMIT"):
        return os.environ["MEGAKERNEL_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=root,  # noqa: E731
                                        timeout=10).stdout.strip()
        if Path(git("rev-parse", "--show-toplevel") or "/nonexistent").resolve() != root:
            return "unknown"
        sha = git("rev-parse", "--short", "HEAD") or "unknown"
        # tracked files changed since that commit (e.g. a device copy whose .git lags the tree): say so
        return sha + "-dirty" if sha != "unknown" and git("status", "--porcelain", "--untracked-files=no") else sha
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_record() -> dict:
    """What every result file carries beside its figures: commit, date, GPU and the command that made it."""
    argv = sys.argv or [""]
    prog = "megakernel" if Path(argv[0]).name in ("__main__.py", "megakernel") else f"python {argv[0]}"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rec = dict(commit=_git_commit(), date=datetime.now(timezone.utc).isoformat(timespec="seconds"), gpu=gpu,
               command=" ".join([prog, *argv[1:]]))
    # the overrides that change what the command measures without showing in it (the kernel's build switches, the
    # megakernel's plan knobs)
    env = {k: os.environ[k] for k in ("MEGAKERNEL_KERNEL_DEFINES", "MEGAKERNEL_CARD_SWITCHES", "MEGAKERNEL_MK_TUNING",
                                      "MEGAKERNEL_BLOCKS_PER_SM",
                                      "MEGAKERNEL_ATTN_MAX_STAGES", "MEGAKERNEL_ATTN_CHUNK") if os.environ.get(k)}
    if env:
        rec["env"] = env
    if torch.cuda.is_available():       # the megakernel's row of kernel/tuning.py for this GPU: its plan starts there
        card = card_tuning(gpu)                        # ($MEGAKERNEL_MK_TUNING, under env, overrides it)
        if card:
            rec["megakernel_card_tuning"] = card
        switches = card_switches(gpu)                  # its build switches ($MEGAKERNEL_KERNEL_DEFINES, under env,
        if switches:                                   # overrides them)
            rec["megakernel_card_switches"] = switches
    return rec


@dataclass
class PrefillPoint:
    prompt_tokens: int
    concurrency: int
    chunk_tokens: int
    ttft_s: float
    prefill_tokens_per_s: float
    peak_gib: float
    backend: str


def _prefill_point(engine, cfg: ModelConfig, n: int, concurrency: int, tag: str) -> PrefillPoint:
    """Time to first token of `concurrency` prompts of n tokens submitted together (the engine's defaults)."""
    from megakernel import SamplingParams

    g = torch.Generator().manual_seed(n * 7 + concurrency)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(concurrency):
        engine.add_request(f"{tag}-{i}", torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(),
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    done = 0
    while done < concurrency:
        done += sum(1 for o in engine.step() if o.finished)
    torch.cuda.synchronize()
    ttft = time.perf_counter() - t0
    engine.drain()
    return PrefillPoint(n, concurrency, engine.chunk_tokens, ttft, n * concurrency / ttft,
                        torch.cuda.max_memory_allocated() / 2**30, engine.runner.backend_name)


def _stream_gaps(engine, cfg: ModelConfig, n_long: int, n_streams: int = 4) -> dict:
    """Longest gap between two tokens of each running stream while one n_long-token prompt prefills."""
    from megakernel import SamplingParams

    g = torch.Generator().manual_seed(11)
    for i in range(n_streams):
        engine.add_request(f"stream-{i}", torch.randint(0, cfg.vocab_size, (64,), generator=g).tolist(),
                           SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True))
    while any(len(s.output_token_ids) < 2 for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    engine.add_request("long", torch.randint(0, cfg.vocab_size, (n_long,), generator=g).tolist(),
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    last = {f"stream-{i}": time.perf_counter() for i in range(n_streams)}
    counts = {k: 0 for k in last}
    worst = 0.0
    t0 = time.perf_counter()
    long_done = None
    while long_done is None:
        for o in engine.step():
            now = time.perf_counter()
            if o.request_id == "long" and o.finished:
                long_done = now - t0
            elif o.request_id in last:
                n = len(o.outputs[0].token_ids)
                if n > counts[o.request_id]:
                    worst = max(worst, now - last[o.request_id])
                    last[o.request_id], counts[o.request_id] = now, n
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.drain()
    return dict(long_prompt_tokens=n_long, streams=n_streams, long_ttft_s=long_done, worst_stream_gap_s=worst,
                chunk_tokens=engine.chunk_tokens)


def _attn_tuning_label(engine) -> str:
    if not engine.model.fast_prefill:
        return ""
    from megakernel.ops.prefill_attention import default_tuning

    return f" (attention {default_tuning().label()})"


PREFILL_PROMPTS = [1024, 8192, 32768, 131072, 262144]


def run_prefill_bench(args: argparse.Namespace) -> int:
    """TTFT and prefill tok/s through the engine with its defaults (chunk size, memory budget), North dims."""
    from megakernel.config import north_mini_code_config
    from megakernel.engine.llm_engine import EngineArgs, LLMEngine
    from megakernel.errors import MegakernelError
    from megakernel.model.weights import random_weights

    if not torch.cuda.is_available():
        raise MegakernelError("bench --prefill measures the GPU path; this machine has no CUDA GPU")
    cfg = north_mini_code_config()
    prompts = [n for n in PREFILL_PROMPTS if n <= args.max_context]
    weights = random_weights(cfg, torch.device("cuda"), torch.bfloat16, seed=0)
    backend = (args.backends or args.backend).split(",")[0]
    engine = LLMEngine(EngineArgs(backend=backend, max_num_seqs=16, max_model_len=max(prompts) + 64,
                                  max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
                                  progress=False), config=cfg, weights=weights)
    print(f"prefill through the engine: chunk {engine.chunk_tokens} tokens, decode backend "
          f"{engine.runner.backend_name}, fast prefill {'on' if engine.model.fast_prefill else 'off'}"
          f"{_attn_tuning_label(engine)}", flush=True)
    _prefill_point(engine, cfg, 512, 1, "warm")              # compiles the kernels
    results: list[PrefillPoint] = []
    for n, conc in [(n, 1) for n in prompts] + [(2048, 8)]:
        p = _prefill_point(engine, cfg, n, conc, f"p{n}x{conc}")
        results.append(p)
        print(f"prefill {conc} x {n} tokens: TTFT {p.ttft_s:.2f} s, {p.prefill_tokens_per_s:.0f} tok/s, peak "
              f"{p.peak_gib:.1f} GiB", flush=True)
        if p.ttft_s * 4.2 > args.prefill_budget_s and n < max(prompts):
            print(f"  stopping: the next (4x longer) prompt would exceed --prefill-budget-s {args.prefill_budget_s}")
            break
    gaps = _stream_gaps(engine, cfg, min(32768, max(prompts)))
    print(f"while a {gaps['long_prompt_tokens']}-token prompt prefilled ({gaps['long_ttft_s']:.2f} s), the longest gap "
          f"between two tokens of {gaps['streams']} running streams was {gaps['worst_stream_gap_s'] * 1e3:.0f} ms",
          flush=True)
    if args.json:
        doc = dict(**run_record(), torch=torch.__version__, points=[asdict(p) for p in results], stream_gaps=gaps)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from megakernel.config import north_mini_code_config
    from megakernel.engine.llm_engine import EngineArgs, LLMEngine
    from megakernel.model.weights import random_weights

    if args.prefill:
        return run_prefill_bench(args)
    points = _points(args)
    backends = args.backends.split(",") if args.backends else [args.backend]
    if args.random_north and not torch.cuda.is_available():
        from megakernel.errors import MegakernelError

        raise MegakernelError("--random-north builds North Mini Code's 61 GB of weights on a GPU; this machine has "
                              "none (use --model with a small checkpoint on CPU)")
    max_b = max(b for b, _ in points)
    max_len = max(c for _, c in points) + args.steps + 32
    common = dict(device=args.device, dtype=args.dtype, max_num_seqs=max_b, max_model_len=max(max_len,
                  args.max_model_len or 0), enable_prefix_caching=False, async_scheduling=not args.sync_steps,
                  progress=False, num_kv_blocks=args.num_kv_blocks)
    weights, cfg = None, None
    if args.random_north:
        cfg = north_mini_code_config()
        t0 = time.perf_counter()
        weights = random_weights(cfg, torch.device(args.device or "cuda"), torch.bfloat16, seed=0)
        print(f"random North Mini Code weights built in {time.perf_counter() - t0:.0f} s", flush=True)
    peak = None
    peaks: dict[str, float] = {}
    results: list[Point] = []
    skipped: list[dict] = []                                 # points a backend's engine could not hold, and why
    mode = "synchronous steps" if args.sync_steps else "pipelined steps"
    for backend in backends:
        t0 = time.perf_counter()
        if weights is not None:
            engine = LLMEngine(EngineArgs(backend=backend, **common), config=cfg, weights=weights)
        else:
            engine = LLMEngine(EngineArgs(model=args.model, backend=backend, **common))
            cfg = engine.config
        print(f"backend {engine.runner.backend_name}: engine ready in {time.perf_counter() - t0:.0f} s", flush=True)
        if peak is None and engine.device.type == "cuda":
            peaks = {k: v / 1e9 for k, v in measure_read_bandwidths(engine.device, args.peak).items()}
            peak = max(peaks.values())
            print(f"peak read bandwidth {peak:.0f} GB/s measured ("
                  + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()) + ")", flush=True)
        for B, ctx in points:
            steps = args.steps if backend != "torch" else min(args.steps, args.torch_steps)
            trace = None
            if args.trace:
                trace = args.trace if len(points) == 1 else args.trace.replace(".json", f"_b{B}_c{ctx}.json")
            try:
                p = _run_point(engine, cfg, B, ctx, steps, args.kv_fill, peak, f"{backend}-{B}-{ctx}",
                               kernels=args.profile_kernels, trace_path=trace)
            except (RequestError, OutOfKVBlocks) as e:       # (the point's prompts do not fit this engine's KV pool,
                _abort_all(engine)                           # alone or together: on a smaller card, or beside a
                                                             # backend's own memory)
                skipped.append(dict(backend=engine.runner.backend_name, batch_size=B, context=ctx, reason=str(e)))
                print(f"backend {engine.runner.backend_name}, batch {B}, context {ctx}: skipped ({e})", flush=True)
                continue
            results.append(p)
            roof = f", {p.roofline_pct:.1f}% of the roofline (roofline {p.roofline_tokens_per_s:.0f} tok/s)" \
                if p.roofline_pct is not None else ""
            print(f"backend {p.backend} ({mode}), batch {B}, context {ctx}: {p.ms_per_step:.2f} ms/step, "
                  f"{p.tokens_per_s:.1f} tok/s, {p.bytes_per_step / 1e9:.2f} GB/step read, {p.gb_per_s:.0f} GB/s "
                  f"achieved{roof}", flush=True)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    _print_table(results)
    if args.json:
        doc = dict(**run_record(), peak_read_gb_per_s=peak, peak_read_by_method=peaks, kv_fill=args.kv_fill, mode=mode,
                   torch=torch.__version__,
                   points=[asdict(p) for p in results], skipped=skipped)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
        if args.plot:
            from megakernel.bench_plot import plot_decode

            plot_decode(doc, args.plot)
            print(f"wrote {args.plot}")
    return 0


def _print_table(results: list[Point]) -> None:
    if not results:
        return
    print(f"\n{'backend':<11}{'batch':>6}{'context':>9}{'ms/step':>10}{'tok/s':>9}{'GB/s':>7}{'roofline':>10}")
    for p in results:
        roof = f"{p.roofline_pct:.1f}%" if p.roofline_pct is not None else "-"
        print(f"{p.backend:<11}{p.batch_size:>6}{p.context:>9}{p.ms_per_step:>10.2f}{p.tokens_per_s:>9.1f}"
              f"{p.gb_per_s:>7.0f}{roof:>10}")
    by = {(p.backend, p.batch_size, p.context): p for p in results}
    if any(k[0] == "megakernel" for k in by) and any(k[0] == "graph" for k in by):
        print("\nmegakernel / graph tok/s: " + ", ".join(
            f"b{b} {c // 1024}K {by[('megakernel', b, c)].tokens_per_s / by[('graph', b, c)].tokens_per_s:.2f}x"
            for (be, b, c) in by if be == "megakernel" and ("graph", b, c) in by))


def add_bench_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("--random-north", action="store_true", help="North Mini Code dimensions, random weights (GPU)")
    b.add_argument("--backends", default=None,
                   help="comma-separated decode backends measured in this run, e.g. megakernel,graph,torch "
                        "(default: --backend)")
    b.add_argument("--batch-size", "--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                   help="batch size(s), comma-separated (default: 1)")
    b.add_argument("--context", "--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1024],
                   help="context length(s) in tokens, comma-separated (default: 1024)")
    b.add_argument("--sweep", action="store_true",
                   help="the standard sweep: batch 1 at 1K..256K, batch 1..16 at 8K (instead of the lists)")
    b.add_argument("--max-context", type=int, default=262144, help="drop sweep points beyond this context")
    b.add_argument("--steps", type=int, default=32, help="timed decode steps per point (default: 32)")
    b.add_argument("--num-kv-blocks", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="exact KV blocks per group (full[,sliding]) instead of the engine's memory budget; a point "
                        "whose prompts do not fit the pool is skipped, and listed as such in the JSON")
    b.add_argument("--torch-steps", type=int, default=4, help="timed steps per point for the torch backend")
    b.add_argument("--kv-fill", choices=["synthetic", "prefill"], default="synthetic",
                   help="how each point's context gets into the KV cache (default: synthetic random K/V)")
    b.add_argument("--sync-steps", action="store_true",
                   help="read each step back before preparing the next (default: pipelined)")
    b.add_argument("--prefill", action="store_true",
                   help="prefill instead: TTFT and tok/s of 1K..256K prompts and 8 concurrent 2K ones, and the "
                        "longest gap of running streams while a 32K prompt prefills (GPU, North dims)")
    b.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="--prefill: tokens per step (default: the engine's)")
    b.add_argument("--prefill-budget-s", type=float, default=120.0,
                   help="--prefill: skip longer prompts once the next would take more than this")
    b.add_argument("--profile-kernels", action="store_true",
                   help="print each point's GPU time per step by kernel (torch profiler; GPU only)")
    b.add_argument("--trace", default=None,
                   help="megakernel: write one profiled step's Chrome/Perfetto trace here (.json or .json.gz), with "
                        "a PNG, a summary and the raw records (.npz) beside it, and time the profiling build against "
                        "the normal one; a path ending in .npz writes only the records and the summary (fast)")
    b.add_argument("--peak", choices=PEAK_METHODS, default="torch",
                   help="the roofline's peak read bandwidth by a torch reduction (default), by every SM's bulk copies "
                        "(sm_90: the copies the megakernel streams with, which read faster), or the best of both")
    b.add_argument("--json", default=None, help="write every figure to this JSON file")
    b.add_argument("--plot", default=None, help="with --json: also draw tok/s and %% of roofline to this PNG")
