"""Tune the Triton prefill flash attention (megakernel/ops/prefill_attention.py) on a GPU: times
`prefill_attention` over a paged KV cache at North Mini Code attention dims (32 query heads, 4 kv heads, head_dim
128, 64-token blocks in a shuffled table) for a grid of `PrefillAttnTuning` configs and chunk shapes.

    python benchmarks/prefill_attention_tune.py --json OUT.json [--budget-s 80] [--rows 128,256]
    python benchmarks/prefill_attention_tune.py --dry-run        # CPU: Triton interpreter, tiny dims and configs

Shapes: one 8192-token chunk at offsets 0, 24576 (32K total), 122880 (128K), 253952 (256K) with full attention,
and one at 122880 with a 4096 sliding window. TFLOP/s counts the (query, key) pairs actually visible:
4 * heads * head_dim * pairs. Every config's output is compared with the default config's (max abs diff; a
relative difference over 2e-2 fails the run), and the default's with fp32 attention on a few rows per shape.
"Overall" is the least time of one forward over the shapes' chunks at the model's mix of 13 full-attention and
36 sliding-window layers. Configs compile in parallel worker processes first (Triton's disk cache), so the whole
grid takes well under 90 s on an H200; configs that fail to compile or launch (shared memory) are skipped with the
reason printed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

REL_TOL = 2e-2
FULL_LAYERS, WINDOW_LAYERS = 13, 36


def dims(dry: bool) -> dict:
    if dry:
        return dict(heads=4, kv_heads=2, head_dim=16, block_size=8, chunk=24,
                    shapes=[("c24@0", 0, None), ("c24@40", 40, None), ("c24@104", 104, None),
                            ("swa24@104", 104, 24)])
    return dict(heads=32, kv_heads=4, head_dim=128, block_size=64, chunk=8192,
                shapes=[("8K@0", 0, None), ("32K", 24576, None), ("128K", 122880, None), ("256K", 253952, None),
                        ("swa4K@128K", 122880, 4096)])


def config_grid(dry: bool, rows: list[int]):
    from megakernel.ops.prefill_attention import PrefillAttnTuning

    default = PrefillAttnTuning()
    if dry:
        grid = [PrefillAttnTuning(block_n=bn, num_warps=4, num_stages=2, block_rows=br)
                for br, bn in itertools.product((16, 32), (16, 32))]
        return grid[0], grid
    grid = [PrefillAttnTuning(block_n=bn, num_warps=nw, num_stages=ns, block_rows=br)
            for br, nw, bn, ns in itertools.product(rows, (8, 4), (64, 128), (2, 3, 4))]
    # the unlikely ones last (the time budget drops them first): 256 rows on one warpgroup spill the accumulator
    grid.sort(key=lambda t: t.block_rows > 128 and t.num_warps < 8)
    grid = [default] + [t for t in grid if t != default]
    return default, grid


def visible_pairs(offset: int, n: int, window: int | None) -> int:
    """(query, key) pairs with key <= query and query - key < window, for queries at [offset, offset + n)."""
    return sum(min(p + 1, window) if window else p + 1 for p in range(offset, offset + n))


class Setup:
    """One layer's paged cache for the longest shape and a chunk's q (a view into a QKV-shaped buffer)."""

    def __init__(self, d: dict, dev, seed: int = 0):
        import torch

        self.d, self.dev = d, dev
        nh, nkv, hd, bs, n = d["heads"], d["kv_heads"], d["head_dim"], d["block_size"], d["chunk"]
        longest = max(off for _, off, _ in d["shapes"]) + n
        nblk = math.ceil(longest / bs) + 2
        g = torch.Generator(device=dev).manual_seed(seed)
        self.kv = torch.randn(nblk, 2, bs, nkv, hd, device=dev, generator=g, dtype=torch.bfloat16)
        self.table = torch.randperm(nblk, device=dev, generator=g).tolist()
        qkv = torch.randn(n, (nh + 2 * nkv) * hd, device=dev, generator=g, dtype=torch.bfloat16)
        self.q = qkv[:, :nh * hd].view(n, nh, hd)
        self.out = torch.empty(n, nh, hd, device=dev, dtype=torch.bfloat16)
        self.scale = hd ** -0.5

    def plan(self, tuning, offset: int, n: int | None = None):
        from megakernel.ops.prefill_attention import plan_prefill, rows_per_item

        n = self.d["chunk"] if n is None else n
        need = math.ceil((offset + n) / self.d["block_size"])
        return plan_prefill([(0, n, offset, self.table[:need])],
                            rows_per_item(self.d["heads"], self.d["kv_heads"], tuning), self.dev)

    def run(self, plan, window, tuning, rows: int | None = None):
        from megakernel.ops.prefill_attention import prefill_attention

        q, out = (self.q, self.out) if rows is None else (self.q[:rows], self.out[:rows])
        prefill_attention(q, out, self.kv, plan, window, self.scale, tuning)


def interpreter_setup() -> None:
    """--dry-run: Triton's interpreter (before megakernel.ops is imported) with the CPU tests' mends of it."""
    os.environ["TRITON_INTERPRET"] = "1"
    conftest = Path(__file__).resolve().parent.parent / "tests" / "graph" / "conftest.py"
    if conftest.exists():       # numpy >= 2.3 and bf16 rounding in the interpreter
        import importlib.util

        spec = importlib.util.spec_from_file_location("_prefill_tune_interp_mends", conftest)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _compile_worker(job: tuple[list[str], bool]) -> list[tuple[str, str | None, float]]:
    """In a spawned process: launch each config once on a small chunk (with and without a window), which compiles
    it into Triton's disk cache with the same specialisation as the full-size runs."""
    labels, dry = job
    if dry:
        interpreter_setup()
    import torch

    from megakernel.ops.prefill_attention import PrefillAttnTuning

    d = dims(dry)
    small = 16 if dry else 256
    s = Setup({**d, "chunk": small, "shapes": [("small", 0, None)]}, torch.device("cpu" if dry else "cuda"))
    window = d["shapes"][-1][2]
    res = []
    for label in labels:
        t0 = time.perf_counter()
        t = PrefillAttnTuning.parse(label)
        try:
            for w in (None, window):
                s.run(s.plan(t, 0, small), w, t)
            if not dry:
                torch.cuda.synchronize()
            res.append((label, None, time.perf_counter() - t0))
        except Exception as e:  # out of shared memory, say
            res.append((label, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                        time.perf_counter() - t0))
    return res


def precompile(grid, workers: int, dry: bool) -> dict[str, str]:
    """Compile the grid in parallel worker processes; returns {label: why it failed}."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    labels = [t.label() for t in grid]
    workers = max(1, min(workers, len(labels)))
    parts = [labels[i::workers] for i in range(workers)]
    failed = {}
    t0 = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for res in ex.map(_compile_worker, [(p, dry) for p in parts]):
            for label, err, _ in res:
                if err:
                    failed[label] = err
    print(f"compiled {len(labels)} configs in {time.perf_counter() - t0:.1f} s ({workers} processes); "
          f"{len(failed)} failed", flush=True)
    return failed


def timer(cuda: bool):
    import torch

    def once(fn, reps: int) -> float:
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps

    return once


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU check of this script: Triton interpreter, tiny dims and configs")
    ap.add_argument("--budget-s", type=float, default=80.0,
                    help="stop starting configs once the run would pass this many seconds")
    ap.add_argument("--rows", default="128,256", help="block_rows values of the grid (query rows per program)")
    ap.add_argument("--target-ms", type=float, default=60.0, help="timed milliseconds per (config, shape)")
    ap.add_argument("--workers", type=int, default=12,
                    help="compile processes (0: compile in this process; --dry-run defaults to 0)")
    ap.add_argument("--shapes", help="comma-separated subset of the shape names")
    args = ap.parse_args()
    if args.dry_run and "--workers" not in sys.argv:
        args.workers = 0
    t_start = time.perf_counter()
    if args.dry_run:
        interpreter_setup()
    import torch
    import triton

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("no CUDA device: use --dry-run for the CPU check", file=sys.stderr)
        return 2
    from megakernel.ops.prefill_attention import prefill_attention_reference

    d = dims(args.dry_run)
    if args.shapes:
        keep = set(args.shapes.split(","))
        d["shapes"] = [s for s in d["shapes"] if s[0] in keep]
    default, grid = config_grid(args.dry_run, [int(x) for x in args.rows.split(",")])
    dev = torch.device("cuda" if cuda else "cpu")
    device_name = torch.cuda.get_device_name(dev) if cuda else "cpu (Triton interpreter)"
    print(f"{device_name}; torch {torch.__version__}, triton {triton.__version__}; {len(grid)} configs, "
          f"{len(d['shapes'])} shapes; default {default.label()}", flush=True)
    failed = precompile(grid, args.workers, args.dry_run) if args.workers > 0 else {}
    s = Setup(d, dev)
    n, once = d["chunk"], timer(cuda)
    flop_per_pair = 4 * d["heads"] * d["head_dim"]
    shapes = [dict(name=name, offset=off, window=w, pairs=visible_pairs(off, n, w)) for name, off, w in d["shapes"]]

    # the default config: baseline outputs, and a check of them against fp32 attention on a few rows
    base, ref_check, ok_all = {}, {}, True
    for sh in shapes:
        plan = s.plan(default, sh["offset"])
        s.out.fill_(float("nan"))
        s.run(plan, sh["window"], default)
        base[sh["name"]] = s.out.clone()
        rows = sorted({0, 1, n // 2, n - 2, n - 1} | set(range(n - 8, n)))
        worst = 0.0
        for i in range(0, len(rows), 8):
            r = torch.tensor(rows[i:i + 8], device=dev)
            ref = prefill_attention_reference(s.q[r], s.kv, s.table, sh["offset"] + r, sh["window"], s.scale)
            got = base[sh["name"]][r].float()
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
        ref_check[sh["name"]] = worst
        good = worst <= REL_TOL
        ok_all &= good
        print(f"default vs fp32 reference at {sh['name']}: relative max diff {worst:.2e}"
              f"{'' if good else '  FAIL'}", flush=True)

    results, durations = [], []
    for t in grid:
        label = t.label()
        elapsed = time.perf_counter() - t_start
        if durations and elapsed + 1.5 * max(durations[-3:]) > args.budget_s:
            print(f"{label}: skipped (time budget {args.budget_s:.0f} s)")
            results.append(dict(config=label, **t.__dict__, skipped="time budget"))
            continue
        if label in failed:
            print(f"{label}: skipped, failed to compile or launch: {failed[label]}")
            results.append(dict(config=label, **t.__dict__, error=failed[label]))
            continue
        t0 = time.perf_counter()
        slow_ref = {r["shape"]: r["ms"] for r in results if r.get("config") == default.label() and "ms" in r}
        for sh in shapes:
            row = dict(config=label, **t.__dict__, shape=sh["name"])
            try:
                plan = s.plan(t, sh["offset"])
                s.out.fill_(float("nan"))
                fn = lambda: s.run(plan, sh["window"], t)  # noqa: E731
                est = once(fn, 1)                           # compile/load, and an estimate
                est = once(fn, 1)
                reps = max(1, min(20, round(args.target_ms / max(est, 1e-3))))
                if sh["name"] in slow_ref and est > 3 * slow_ref[sh["name"]]:
                    reps = 0                                 # far slower than the default: one run is enough
                ms = once(fn, reps) if reps else est
            except Exception as e:  # out of shared memory, say
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                print(f"{label} {sh['name']}: failed: {why}")
                results.append({**row, "error": why})
                break
            diff = float((s.out.float() - base[sh["name"]].float()).abs().max())
            rel = diff / float(base[sh["name"]].float().abs().max())
            good = rel <= REL_TOL          # NaN (rows left unwritten) fails too
            ok_all &= good
            row.update(ms=ms, tflops=flop_per_pair * sh["pairs"] / ms / 1e9, max_abs_diff=diff, rel_diff=rel,
                       ok=good)
            results.append(row)
            print(f"{label:55s} {sh['name']:>11s} {ms:9.3f} ms {row['tflops']:7.1f} TFLOP/s  "
                  f"max|diff| {diff:.2e}{'' if good else '  FAIL (relative ' + f'{rel:.2e})'}", flush=True)
        durations.append(time.perf_counter() - t0)

    ok = [r for r in results if r.get("ok")]
    best_shape = {}
    for sh in shapes:
        rs = [r for r in ok if r["shape"] == sh["name"]]
        if rs:
            b = min(rs, key=lambda r: r["ms"])
            dflt = next((r for r in rs if r["config"] == default.label()), None)
            best_shape[sh["name"]] = dict(config=b["config"], ms=b["ms"], tflops=b["tflops"],
                                          default_ms=dflt and dflt["ms"], default_tflops=dflt and dflt["tflops"])
    weight = {sh["name"]: WINDOW_LAYERS if sh["window"] else FULL_LAYERS for sh in shapes}
    totals = {}
    for label in dict.fromkeys(r["config"] for r in ok):
        rs = {r["shape"]: r["ms"] for r in ok if r["config"] == label}
        if len(rs) == len(shapes):
            totals[label] = sum(weight[k] * v for k, v in rs.items())
    print("\nbest per shape:")
    for name, b in best_shape.items():
        print(f"  {name:>11s}: {b['tflops']:7.1f} TFLOP/s {b['ms']:9.3f} ms  {b['config']}  "
              f"(default {b['default_tflops'] or float('nan'):.1f} TFLOP/s)")
    best = None
    if totals:
        label = min(totals, key=totals.get)
        best = dict(config=label, model_ms=totals[label], default_model_ms=totals.get(default.label()),
                    env="MEGAKERNEL_PREFILL_ATTN=" + label)
        print(f"best overall ({FULL_LAYERS} full + {WINDOW_LAYERS} window layers over the shapes): {label}: "
              f"{totals[label]:.1f} ms (default {totals.get(default.label(), float('nan')):.1f} ms)\n"
              f"  {best['env']}")
    wall = time.perf_counter() - t_start
    print(f"{'all outputs agree' if ok_all else 'FAIL: some outputs differ'}; {wall:.1f} s")
    if args.json:
        from megakernel.bench import run_record

        Path(args.json).write_text(json.dumps(dict(
            **run_record(), device=device_name, torch=torch.__version__, triton=triton.__version__, dims={**d, "shapes": shapes},
            default=default.label(), rel_tol=REL_TOL, reference_check=ref_check, results=results,
            best_per_shape=best_shape, best_overall=best, ok=ok_all, wall_s=wall), indent=1))
        print(f"wrote {args.json}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
