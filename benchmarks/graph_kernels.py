"""Microbenchmark of the graph backend's kernels at North Mini Code dimensions (GPU): each variant runs over every
layer's own weights (so nothing is served from L2), captured in a CUDA graph, median of replays.

    python3 benchmarks/graph_kernels.py [--batch 1,8] [--only moe,attn,gemv] [--json out.json]

Prints microseconds per layer and GB/s per variant; the defaults in `megakernel.graph.backend.GraphTuning` come
from here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import torch.nn.functional as F

from megakernel.config import north_mini_code_config
from megakernel.graph.attention import DecodeAttention
from megakernel.graph.backend import fuse_router_into_qkv
from megakernel.graph.gemv import gemv
from megakernel.graph.moe import DecodeMoE
from megakernel.kv.cache import KVCache, KVLayout
from megakernel.model.weights import random_weights


def time_graph(fn, reps: int = 15) -> float:
    """Median ms of one replay of a graph capturing fn()."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_moe(cfg, w, B: int, results: list) -> None:
    dev = w.device
    n_qkv = cfg.q_size + 2 * cfg.kv_size
    layers = [w.layers[i] for i in cfg.moe_layers]
    gen = torch.Generator(device=dev).manual_seed(B)
    qkv = [torch.randn(B, n_qkv + cfg.num_experts, device=dev, generator=gen).to(torch.bfloat16) for _ in layers]
    x = torch.randn(B, cfg.hidden_size, device=dev, generator=gen).to(torch.bfloat16)
    n_rows = torch.tensor([B], dtype=torch.int32, device=dev)
    y = torch.empty(B, cfg.num_experts_per_tok, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
    topk = torch.empty(B, cfg.num_experts_per_tok, dtype=torch.int32, device=dev)
    distinct = sum(int(torch.topk(q[:, n_qkv:].float(), cfg.num_experts_per_tok).indices.unique().numel())
                   for q in qkv) / len(qkv)
    per_expert = cfg.hidden_size * cfg.moe_intermediate_size * 2
    gu_bytes, dn_bytes = distinct * 2 * per_expert, distinct * per_expert
    for bn, bk, (nw, ns) in itertools.product((16, 32, 64), (128, 256), ((4, 3), (4, 4), (8, 4))):
        moe = DecodeMoE(cfg, B, dev, gu_block_n=bn, dn_block_n=bn, gu_block_k=bk, dn_block_k=bk, num_warps=nw,
                        gu_stages=ns, dn_stages=ns)
        try:
            t_gu = time_graph(lambda: [moe.gate_up(q[:, n_qkv:], x, lw.moe.experts_gate_up, n_rows, topk)
                                       for q, lw in zip(qkv, layers)]) / len(layers)
            t_dn = time_graph(lambda: [moe.down(q[:, n_qkv:], lw.moe.experts_down, n_rows, y)
                                       for q, lw in zip(qkv, layers)]) / len(layers)
        except Exception as e:  # out of shared memory for a large tile, say
            print(f"moe B={B} bn={bn} bk={bk} w={nw} s={ns}: {type(e).__name__}")
            continue
        r = dict(kind="moe", B=B, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, distinct=distinct,
                 gate_up_us=t_gu * 1e3, down_us=t_dn * 1e3, gate_up_gbps=gu_bytes / t_gu / 1e6,
                 down_gbps=dn_bytes / t_dn / 1e6)
        results.append(r)
        print(f"moe B={B} bn={bn:3d} bk={bk:3d} w={nw} s={ns}: gate_up {r['gate_up_us']:6.1f} us "
              f"({r['gate_up_gbps']:5.0f} GB/s)  down {r['down_us']:6.1f} us ({r['down_gbps']:5.0f} GB/s)")


def bench_attention(cfg, B: int, ctx: int, results: list) -> None:
    dev = torch.device("cuda")
    layout = KVLayout.for_model(cfg, 64)
    per_row = [-(-ctx // 64) + 1, -(-cfg.sliding_window // 64) + 2]
    cache = KVCache(layout, [B * n + 1 for n in per_row], dev, torch.bfloat16)
    for t in cache.kv:
        t.normal_()
    gen = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(B, cfg.q_size + 2 * cfg.kv_size, device=dev, generator=gen).to(torch.bfloat16)
    pos = torch.full((B,), ctx - 1, dtype=torch.int32, device=dev)
    n_rows = torch.tensor([B], dtype=torch.int32, device=dev)
    tables, bases = [], []
    for g, group in enumerate(layout.groups):
        lo = 0 if group.window is None else max(0, ctx - group.window) // 64
        width = (ctx - 1) // 64 + 1 - lo
        tables.append(torch.arange(B * width, dtype=torch.int32, device=dev).view(B, width))
        bases.append(torch.full((B,), lo, dtype=torch.int32, device=dev))
    cos = torch.ones(B, cfg.head_dim, dtype=torch.bfloat16, device=dev)
    sin = torch.zeros_like(cos)
    out = torch.empty(B, cfg.q_size, dtype=torch.bfloat16, device=dev)
    layers = list(range(cfg.num_layers))
    kv_bytes = sum(min(ctx, cfg.window_for(i) or ctx) for i in layers) * 2 * cfg.kv_size * 2 * B / len(layers)
    for ns_split, bt, (nw, st) in itertools.product((8, 16, 32, 64), (32, 64, 128),
                                                     ((4, 1), (4, 2), (4, 3), (8, 2))):
        if ns_split * B * cfg.num_kv_heads > 1024:
            continue
        att = DecodeAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 64, B, ns_split, dev, block_t=bt,
                              num_warps=nw, num_stages=st)

        def run_splits():
            for i in layers:
                g, lkv = cache.layer(i)
                att.splits(qkv, cos, sin, lkv, tables[g], bases[g], pos, n_rows, cfg.window_for(i), cfg.uses_rope(i))
        try:
            t_s = time_graph(run_splits) / len(layers)
            t_c = time_graph(lambda: [att.combine(n_rows, out) for _ in layers]) / len(layers)
        except Exception as e:
            print(f"attn B={B} nsplit={ns_split} bt={bt} w={nw} s={st}: {type(e).__name__}")
            continue
        r = dict(kind="attn", B=B, ctx=ctx, nsplit=ns_split, block_t=bt, num_warps=nw, num_stages=st,
                 splits_us=t_s * 1e3, combine_us=t_c * 1e3, gbps=kv_bytes / (t_s + t_c) / 1e6)
        results.append(r)
        print(f"attn B={B} ctx={ctx} nsplit={ns_split:2d} bt={bt:3d} w={nw} s={st}: splits {r['splits_us']:6.1f} us "
              f"combine {r['combine_us']:5.1f} us ({r['gbps']:5.0f} GB/s)")


def bench_gemv(cfg, w, qkv_fused, B: int, results: list) -> None:
    dev = w.device
    x = torch.randn(B, cfg.hidden_size, device=dev).to(torch.bfloat16)
    xa = torch.randn(B, cfg.q_size, device=dev).to(torch.bfloat16)
    cases = {"qkv+router": (x, [f for f in qkv_fused]), "o": (xa, [lw.o for lw in w.layers])}
    for name, (inp, mats) in cases.items():
        nbytes = sum(m.numel() for m in mats) * 2 / len(mats)
        t = time_graph(lambda: [F.linear(inp, m) for m in mats]) / len(mats)
        results.append(dict(kind="gemv", B=B, name=name, impl="cublas", us=t * 1e3, gbps=nbytes / t / 1e6))
        print(f"gemv B={B} {name:10s} cublas: {t * 1e3:6.1f} us ({nbytes / t / 1e6:5.0f} GB/s)")
        for bn, bk, (nw, ns) in itertools.product((16, 32), (128, 256, 512), ((4, 3), (4, 4), (8, 4))):
            try:
                t = time_graph(lambda: [gemv(inp, m, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                                        for m in mats]) / len(mats)
            except Exception as e:
                print(f"gemv {name} bn={bn} bk={bk}: {type(e).__name__}")
                continue
            results.append(dict(kind="gemv", B=B, name=name, impl="triton", block_n=bn, block_k=bk, num_warps=nw,
                                num_stages=ns, us=t * 1e3, gbps=nbytes / t / 1e6))
            print(f"gemv B={B} {name:10s} triton bn={bn} bk={bk} w={nw} s={ns}: {t * 1e3:6.1f} us "
                  f"({nbytes / t / 1e6:5.0f} GB/s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--only", default="moe,attn,gemv")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = north_mini_code_config()
    only = set(args.only.split(","))
    results: list = []
    w = qkv_fused = None
    if only & {"moe", "gemv"}:
        w = random_weights(cfg, torch.device("cuda"), torch.bfloat16, seed=0)
        qkv_fused = fuse_router_into_qkv(w)
    for B in [int(b) for b in args.batch.split(",")]:
        if "gemv" in only:
            bench_gemv(cfg, w, qkv_fused, B, results)
        if "attn" in only:
            bench_attention(cfg, B, args.ctx, results)
        if "moe" in only:
            bench_moe(cfg, w, B, results)
    for kind, key in (("moe", lambda r: r["gate_up_us"]), ("moe", lambda r: r["down_us"]),
                      ("attn", lambda r: r["splits_us"] + r["combine_us"]), ("gemv", lambda r: r["us"])):
        for B in {r["B"] for r in results if r["kind"] == kind}:
            groups = {r.get("name", "") for r in results if r["kind"] == kind and r["B"] == B}
            for name in groups:
                sel = [r for r in results if r["kind"] == kind and r["B"] == B and r.get("name", "") == name]
                best = min(sel, key=key)
                print(f"BEST {kind} {name} B={B}: {best}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
