"""`GraphBackend`: the whole decode step of a padded batch bucket (1, 2, 4, 8, 16 rows) captured as one CUDA graph
and replayed every step.

Per layer the step is: residual add + norm (Triton), the fused QKV + router projection (cuBLAS), paged attention
with RoPE and the K/V append (Triton, split-KV + combine), the output projection (cuBLAS), and the routed experts
(two Triton kernels that route on the device and read only the chosen experts' weights). Everything a step varies
(token ids, positions, block tables, the number of live rows) lives in static device buffers the host fills
before each replay, so one capture serves every context length, and requests may join, leave, be preempted or hit
the prefix cache between steps. Nothing inside the graph waits for the host.

A batch larger than the largest bucket runs as several replays. Rows of a bucket past the live ones are skipped
by every kernel that writes state (the KV cache is never touched for them) and route to no expert.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from megakernel.config import ModelConfig
from megakernel.graph import graph_available
from megakernel.graph.attention import DecodeAttention
from megakernel.ops.common import pdl_supported
from megakernel.graph.gemv import gemv
from megakernel.graph.moe import DecodeMoE
from megakernel.graph.norm import MLP_DENSE, MLP_NONE, MLP_SHARED_AVG, MLP_SHARED_SUM, add_norm
from megakernel.kv.cache import KVCache
from megakernel.model import layers as L
from megakernel.model.cohere2_moe import ForwardBatch, ForwardTrace
from megakernel.model.decode_backend import Check, DecodeBackend, no_check
from megakernel.model.weights import ModelWeights

log = logging.getLogger("megakernel")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def buckets_for(max_batch: int) -> list[int]:
    """Batch buckets up to max_batch: powers of two, the last one max_batch itself."""
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


@dataclass(frozen=True)
class GraphTuning:
    """Tile shapes and launch choices of the decode step, per bucket size (benchmarks/graph_kernels.py measures
    the alternatives at North Mini Code dimensions on an H200; SPEED_NOTES.md has the figures)."""

    streams: int = 2                # 2: each layer's MLP branch on a second stream, beside attention
    pdl: bool = False               # programmatic dependent launch between our kernels (sm_90+, one stream)
    triton_gemv: bool = False       # QKV and output projections on our GEMV (else cuBLAS)

    @classmethod
    def from_env(cls) -> "GraphTuning":
        """$MEGAKERNEL_GRAPH_TUNING, e.g. "streams=1,pdl=1", overrides the defaults (for measurements)."""
        spec = os.environ.get("MEGAKERNEL_GRAPH_TUNING", "")
        fields = {}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            name, _, value = item.partition("=")
            if name not in ("streams", "pdl", "triton_gemv"):
                raise ValueError(f"MEGAKERNEL_GRAPH_TUNING: unknown setting {name!r} (streams, pdl, triton_gemv)")
            fields[name] = int(value) if name == "streams" else value.strip().lower() in ("1", "true", "on", "yes")
        return cls(**fields)

    def attention(self, rows: int) -> dict:
        # keys per program: few rows want more splits to fill the GPU; 128-key tiles pay with few rows
        nsplit = {1: 32, 2: 32, 4: 16, 8: 16}.get(rows, 8)
        return dict(nsplit=nsplit, block_t=128 if rows <= 2 else 64, num_warps=4, num_stages=1 if rows <= 2 else 2)

    def moe(self, rows: int) -> dict:
        return dict(gu_block_n=64, dn_block_n=64, gu_block_k=128, dn_block_k=256 if rows <= 4 else 128,
                    num_warps=4, gu_stages=4, dn_stages=3)


def fuse_router_into_qkv(weights: ModelWeights) -> list[torch.Tensor]:
    """Per layer, one [qkv rows + router rows, hidden] matrix, so a single GEMV produces q, k, v and the router
    logits. The layer's `qkv` and `moe.router` become views of it (same values; done in place and once)."""
    fused = []
    for lw in weights.layers:
        if lw.moe is None:
            fused.append(lw.qkv)
            continue
        n, r = lw.qkv.shape[0], lw.moe.router
        base = lw.qkv._base if lw.qkv._base is not None else lw.qkv
        if base is r._base and base.shape[0] == n + r.shape[0] and r.data_ptr() == lw.qkv.data_ptr() + \
                lw.qkv.numel() * lw.qkv.element_size():
            fused.append(base)
            continue
        both = torch.cat([lw.qkv, r], dim=0)
        lw.qkv, lw.moe.router = both[:n], both[n:]
        fused.append(both)
    return fused


class DecodeBuffers:
    """The static device tensors every captured graph reads and writes (sized for the largest bucket)."""

    def __init__(self, cfg: ModelConfig, cache: KVCache, rows: int, max_model_len: int, device: torch.device):
        layout = cache.layout
        self.rows = rows
        G = len(layout.groups)
        bs = layout.block_size
        i32 = dict(dtype=torch.int32, device=device)
        # meta: [n_rows | pos (rows) | table base of group g (rows) for each g], uploaded in one copy per step
        self.meta = torch.zeros(1 + rows + G * rows, **i32)
        self.n_rows = self.meta[:1]
        self.pos = self.meta[1:1 + rows]
        self.bases = [self.meta[1 + rows + g * rows:1 + rows + (g + 1) * rows] for g in range(G)]
        self.widths = [(-(-max_model_len // bs) + 1) if g.window is None else (-(-g.window // bs) + 2)
                       for g in layout.groups]
        self.tables = [torch.zeros(rows, w, **i32) for w in self.widths]
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        bf = dict(dtype=torch.bfloat16, device=device)
        H, K = cfg.hidden_size, cfg.num_experts_per_tok
        self.h = torch.zeros(rows, H, **bf)
        self.x = torch.zeros(rows, H, **bf)
        self.attn = torch.zeros(rows, cfg.q_size, **bf)
        self.y = torch.zeros(rows, K, H, **bf)
        self.topk = torch.zeros(max(1, len(cfg.moe_layers)), rows, K, **i32)
        self.logits = torch.zeros(rows, cfg.vocab_size, dtype=torch.float32, device=device)


class GraphStep:
    """The decode step of one bucket (`rows` padded rows), as plain launches: what a graph captures. Runs eagerly
    too (the CPU tests run it under Triton's interpreter)."""

    def __init__(self, cfg: ModelConfig, w: ModelWeights, qkv_fused: list[torch.Tensor], cache: KVCache,
                 buf: DecodeBuffers, rows: int, tuning: GraphTuning = GraphTuning()) -> None:
        self.cfg, self.w, self.qkv, self.cache, self.buf, self.rows = cfg, w, qkv_fused, cache, buf, rows
        dev = buf.h.device
        self.side = torch.cuda.Stream(dev) if tuning.streams > 1 and dev.type == "cuda" else None
        self.pdl = tuning.pdl and pdl_supported(dev) and self.side is None     # PDL edges stay within one stream
        self.triton_gemv = tuning.triton_gemv
        self.n_qkv = cfg.q_size + 2 * cfg.kv_size
        self.qkv_bias = []
        for lw, fused in zip(w.layers, qkv_fused):
            b = lw.qkv_bias
            if b is not None and fused.shape[0] > b.shape[0]:
                b = torch.cat([b, torch.zeros(fused.shape[0] - b.shape[0], dtype=b.dtype, device=b.device)])
            self.qkv_bias.append(b)
        self.attention = DecodeAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cache.layout.block_size,
                                         rows, device=dev, pdl=self.pdl, **tuning.attention(rows))
        self.moe = DecodeMoE(cfg, rows, dev, pdl=self.pdl, **tuning.moe(rows))
        self.moe_index = {l: j for j, l in enumerate(cfg.moe_layers)}

    def run(self, trace: ForwardTrace | None = None) -> None:
        """Enqueue the step. `trace` (uncaptured runs only) records each MoE layer's router logits and, when its
        `hidden` is a list, the residual stream after the embedding and after every layer."""
        cfg, w, b, R = self.cfg, self.w, self.buf, self.rows
        pos = b.pos[:R]
        cos, sin = L.rope_cos_sin(pos.long(), cfg, torch.bfloat16)
        h, x = b.h[:R], b.x[:R]
        add_norm(cfg, h, x, w.layers[0].norm_weight, b.n_rows, embed=w.embed, ids=b.ids[:R], pdl=self.pdl)
        hidden = trace.hidden if trace is not None else None
        if hidden is not None:
            hidden.append(h.clone())
        main = torch.cuda.current_stream(x.device) if self.side is not None else None
        for i, lw in enumerate(w.layers):
            qkv = self._linear(x, self.qkv[i], self.qkv_bias[i])
            if self.side is not None:           # the MLP branch runs beside attention (parallel residual)
                self.side.wait_stream(main)
                with torch.cuda.stream(self.side):
                    y, mlp, kind = self._mlp(i, lw, qkv, x, trace)
            else:
                y, mlp, kind = self._mlp(i, lw, qkv, x, trace)
            g, layer_kv = self.cache.layer(i)
            self.attention(qkv, cos, sin, layer_kv, b.tables[g][:R], b.bases[g][:R], pos, b.n_rows,
                           cfg.window_for(i), cfg.uses_rope(i), b.attn[:R])
            ao = self._linear(b.attn[:R], lw.o, lw.o_bias)
            if self.side is not None:
                main.wait_stream(self.side)
            nw = w.layers[i + 1].norm_weight if i + 1 < cfg.num_layers else w.final_norm
            add_norm(cfg, h, x, nw, b.n_rows, attn_out=ao, y=y, mlp=mlp, mlp_kind=kind, pdl=self.pdl)
            if hidden is not None:
                hidden.append(h.clone())
        b.logits[:R].copy_(F.linear(x, w.lm_head) * cfg.logit_scale)

    def _mlp(self, i: int, lw, qkv: torch.Tensor, x: torch.Tensor, trace: ForwardTrace | None
             ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """Layer i's MLP branch: (expert outputs by rank, dense or shared-expert output, how to combine them)."""
        cfg, b, R = self.cfg, self.buf, self.rows
        if lw.moe is None:
            return None, L.swiglu(x, lw.dense), MLP_DENSE
        y = b.y[:R]
        if trace is not None and trace.router_logits is not None:
            trace.router_logits.append(qkv[:, self.n_qkv:].float().clone())
        self.moe(qkv[:, self.n_qkv:], x, lw.moe.experts_gate_up, lw.moe.experts_down, b.n_rows, y,
                 b.topk[self.moe_index[i], :R])
        if lw.moe.shared is None:
            return y, None, MLP_NONE
        kind = MLP_SHARED_SUM if cfg.shared_expert_combination == "sum" else MLP_SHARED_AVG
        return y, L.swiglu(x, lw.moe.shared), kind

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.triton_gemv:
            return gemv(x, weight, bias, pdl=self.pdl)
        return F.linear(x, weight, bias)


def upload_step(buf: DecodeBuffers, cache: KVCache, batch: ForwardBatch, first: int, n: int,
                positions: list[int]) -> None:
    """Fill the static inputs for rows [first, first + n) of `batch` (pinned uploads: the host never waits)."""
    layout = cache.layout
    bs, rows, G = layout.block_size, buf.rows, len(layout.groups)
    meta = np.zeros(1 + rows + G * rows, dtype=np.int32)
    meta[0] = n
    pos = positions[first:first + n]
    meta[1:1 + n] = pos
    dev = buf.meta.device
    for g, group in enumerate(layout.groups):
        base = [0 if group.window is None else max(0, p - group.window + 1) // bs for p in pos]
        ends = [p // bs + 1 for p in pos]
        width = max(e - s for s, e in zip(base, ends))
        if width > buf.widths[g]:
            raise ValueError(f"position {max(pos)} is beyond the graph backend's max_model_len")
        table = np.zeros((n, width), dtype=np.int32)
        for r in range(n):
            row = batch.block_tables[first + r][g][base[r]:ends[r]]
            table[r, :len(row)] = row
        meta[1 + rows + g * rows:1 + rows + g * rows + n] = base
        staged = torch.from_numpy(table)
        if dev.type == "cuda":
            staged = staged.pin_memory()
        buf.tables[g][:n, :width].copy_(staged, non_blocking=True)
    staged = torch.from_numpy(meta)
    buf.meta.copy_(staged.pin_memory() if dev.type == "cuda" else staged, non_blocking=True)
    buf.ids[:n].copy_(batch.input_ids[first:first + n])


def reserved_bytes(cfg: ModelConfig, max_batch: int) -> int:
    """Device memory the backend takes beside the KV cache (static buffers, graph pools, cuBLAS workspace), as an
    upper bound to reserve before the KV pool is sized."""
    rows = buckets_for(max_batch)[-1]
    H, V, K = cfg.hidden_size, cfg.vocab_size, cfg.num_experts_per_tok
    per_row = (4 * H + cfg.q_size + 2 * K * H + K * cfg.moe_intermediate_size) * 2 + V * (4 + 2 * 2) \
        + (cfg.q_size + 2 * cfg.kv_size + cfg.num_experts) * 2 * 2
    attn = 64 * cfg.num_kv_heads * 16 * max(16, cfg.head_dim) * 4
    return 2 * len(buckets_for(max_batch)) * (rows * per_row + attn) + (96 << 20)


class GraphBackend(DecodeBackend):
    name = "graph"

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, cache: KVCache, max_batch: int = 16,
                 max_model_len: int = 32768, tuning: GraphTuning | None = None) -> None:
        ok, why = graph_available(weights.device)
        if not ok:
            raise RuntimeError(f"the graph decode backend needs a CUDA GPU: {why}")
        if weights.dtype != torch.bfloat16:
            raise ValueError(f"the graph backend runs bf16 weights, got {weights.dtype}")
        self.cfg, self.w, self.cache = cfg, weights, cache
        self.device = weights.device
        tuning = tuning or GraphTuning.from_env()
        self.max_model_len = max_model_len
        self.buckets = buckets_for(max_batch)
        self._cache_ptrs = [t.data_ptr() for t in cache.kv]
        before = torch.cuda.memory_reserved(self.device)
        self.qkv = fuse_router_into_qkv(weights)
        self.buf = DecodeBuffers(cfg, cache, self.buckets[-1], max_model_len, self.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.steps: dict[int, GraphStep] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        for rows in sorted(self.buckets, reverse=True):      # largest first: the smaller ones reuse its pool
            t0 = time.perf_counter()
            step = GraphStep(cfg, weights, self.qkv, cache, self.buf, rows, tuning)
            self.buf.n_rows.zero_()                         # warm-up and capture touch no KV
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                step.run()                                  # compiles the Triton kernels, creates cuBLAS handles
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                step.run()
            self.steps[rows], self.graphs[rows] = step, graph
            log.info("graph backend captured the %d-row decode step in %.1f s", rows,
                     time.perf_counter() - t0)
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        first = self.steps[self.buckets[0]]
        log.info("graph backend uses %.0f MiB beside the KV cache (buckets %s; %d stream(s), PDL %s, "
                 "%s projections)", self.memory_bytes / 2**20, self.buckets, 2 if first.side is not None else 1,
                 "on" if first.pdl else "off", "Triton" if first.triton_gemv else "cuBLAS")

    def decode_async(self, batch: ForwardBatch, cache: KVCache, trace: ForwardTrace | None = None
                     ) -> tuple[torch.Tensor, Check]:
        if [t.data_ptr() for t in cache.kv] != self._cache_ptrs:
            raise ValueError("the graph backend was captured for another KV cache")
        B = batch.num_seqs
        if batch.starts != list(range(B + 1)):
            raise ValueError("the graph backend decodes exactly one new token per sequence")
        positions = batch.host_positions()
        most = self.buckets[-1]
        logits, topk = [], []
        for first in range(0, B, most):
            n = min(most, B - first)
            rows = next(b for b in self.buckets if b >= n)
            upload_step(self.buf, cache, batch, first, n, positions)
            self.graphs[rows].replay()
            logits.append(self.buf.logits[:n].clone())
            if trace is not None:
                topk.append(self.buf.topk[:, :n].clone())
        if trace is not None:
            for j in range(len(self.cfg.moe_layers)):
                trace.experts.append(torch.cat([t[j] for t in topk]).long())
        out = torch.cat(logits) if len(logits) > 1 else logits[0]
        if batch.logits_rows is not None:
            out = out[batch.logits_rows]
        return out, no_check
