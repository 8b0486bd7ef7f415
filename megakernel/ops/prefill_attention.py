"""Flash attention for prefill chunks, straight over the paged KV cache (no gathered copy of the keys).

One program serves BLOCK_M consecutive query tokens of one sequence for one kv head, with that head's G query
heads stacked as rows (GQA: each K/V tile is loaded once for all of them), and streams the visible keys in tiles
of BLOCK_N positions through the sequence's block table: causal from the chunk's offset, and the sliding window
when the layer has one (key k visible to a query at p iff k <= p and p - k < window). Scores and the softmax are
fp32 (online, as in FlashAttention); P is rounded to bf16 for the PV product.

Several sequences' chunks go in one launch: `PrefillPlan` lists (first row, rows, first position, table offset)
work items, built once per forward and shared by every layer of a KV group. The chunk's own K/V must already be
in the cache (the layer writes them before attending).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megakernel.ops.common import INTERPRET, dot, pow2
from megakernel.transfer import to_device


@triton.jit
def prefill_attn_kernel(q, q_stride, out, out_stride, kv, stride_kv, table, items, window, scale,
                        NH: tl.constexpr, NKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                        BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        DOT_F32: tl.constexpr):
    it = tl.program_id(0)
    kvh = tl.program_id(1)
    row0 = tl.load(items + it * 4)
    nrow = tl.load(items + it * 4 + 1)
    pos0 = tl.load(items + it * 4 + 2)
    tbl = tl.load(items + it * 4 + 3)
    rr = tl.arange(0, BLOCK_M * GP)
    tok = rr // GP
    hh = rr % GP
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    rv = (tok < nrow) & (hh < G)
    qpos = pos0 + tok
    head = (kvh * G + hh) * D
    qt = tl.load(q + ((row0 + tok).to(tl.int64) * q_stride + head)[:, None] + dd[None, :],
                 mask=rv[:, None] & dm[None, :], other=0.0)
    qmax = pos0 + nrow - 1
    lo = 0
    if window > 0:
        lo = tl.maximum(pos0 - window + 1, 0)
    m_i = tl.full([BLOCK_M * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GP], tl.float32)
    acc = tl.zeros([BLOCK_M * GP, BLOCK_D], tl.float32)
    tt = tl.arange(0, BLOCK_N)
    for start in range((lo // BLOCK_N) * BLOCK_N, qmax + 1, BLOCK_N):
        kpos = start + tt
        kv_ok = (kpos >= lo) & (kpos <= qmax)
        blk = tl.load(table + tbl + kpos // BS, mask=kv_ok, other=0).to(tl.int64)
        addr = blk * (2 * stride_kv) + (kpos % BS) * (NKV * D) + kvh * D
        lm = kv_ok[:, None] & dm[None, :]
        k = tl.load(kv + addr[:, None] + dd[None, :], mask=lm, other=0.0)
        v = tl.load(kv + stride_kv + addr[:, None] + dd[None, :], mask=lm, other=0.0)
        s = dot(qt, tl.trans(k), DOT_F32) * scale
        vis = kv_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        if window > 0:
            vis = vis & ((qpos[:, None] - kpos[None, :]) < window)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)      # rows with no visible key yet
        alpha = tl.exp(m_i - shift)
        p = tl.exp(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.to(tl.bfloat16), v, DOT_F32)
        m_i = m_new
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out + ((row0 + tok).to(tl.int64) * out_stride + head)[:, None] + dd[None, :], res.to(tl.bfloat16),
             mask=rv[:, None] & dm[None, :])


@dataclass
class PrefillPlan:
    """Work items of one forward's prefill chunks in one KV group: (first row, rows, first position, offset of
    the sequence's block table in `table`), on the device."""

    items: torch.Tensor       # [n, 4] int32
    table: torch.Tensor       # flat int32 block tables of the chunks' sequences
    block_m: int


def rows_per_item(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per program: 128 rows of (token, query head of the kv head's group)."""
    return max(1, 128 // pow2(num_heads // num_kv_heads, 1))


def plan_prefill(chunks: list[tuple[int, int, int, list[int]]], block_m: int, device: torch.device) -> PrefillPlan:
    """chunks: (first row in the flat batch, rows, first position, the sequence's block table in this group)."""
    items, flat = [], []
    for row0, n, pos0, table in chunks:
        off = len(flat)
        flat.extend(table)
        for i in range(0, n, block_m):
            items.append((row0 + i, min(block_m, n - i), pos0 + i, off))
    return PrefillPlan(to_device(items, torch.int32, device).view(-1, 4),
                       to_device([max(b, 0) for b in flat] or [0], torch.int32, device), block_m)


def prefill_attention(q: torch.Tensor, out: torch.Tensor, layer_kv: torch.Tensor, plan: PrefillPlan,
                      window: int | None, scale: float) -> None:
    """q, out: [T, heads, head_dim] bf16, heads and head_dim contiguous (q may be a view into the QKV output);
    only the plan's rows of `out` are written. layer_kv: [blocks, 2, block_size, kv_heads, head_dim]."""
    T, nh, d = q.shape
    assert q.stride(2) == 1 and q.stride(1) == d and out.stride(2) == 1 and out.stride(1) == d
    nkv, bs = layer_kv.shape[3], layer_kv.shape[2]
    g = nh // nkv
    if plan.items.shape[0] == 0:
        return
    prefill_attn_kernel[(plan.items.shape[0], nkv)](
        q, q.stride(0), out, out.stride(0), layer_kv, layer_kv.stride(1), plan.table, plan.items, window or 0, scale,
        NH=nh, NKV=nkv, G=g, GP=pow2(g, 1), D=d, BS=bs, BLOCK_M=plan.block_m, BLOCK_N=64, BLOCK_D=pow2(d),
        DOT_F32=INTERPRET, num_warps=8, num_stages=2)
