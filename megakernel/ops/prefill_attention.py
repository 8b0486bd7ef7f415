"""Flash attention for prefill chunks, straight over the paged KV cache (no gathered copy of the keys).

One program serves BLOCK_M consecutive query tokens of one sequence for one kv head, with that head's G query
heads stacked as rows (GQA: each K/V tile is loaded once for all of them), and streams the visible keys in tiles
of BLOCK_N positions through the sequence's block table: causal from the chunk's offset, and the sliding window
when the layer has one (key k visible to a query at p iff k <= p and p - k < window). Scores and the softmax are
fp32 (online, as in FlashAttention, in base 2 with softmax scale * log2(e) applied once per score); P is rounded to
bf16 for the PV product.

The key loop has three parts. For the program's queries at [pos0, qmax], a tile [s, s + BLOCK_N) is visible to
every query iff s + BLOCK_N - 1 <= pos0 and (with a window) qmax - s < window; those tiles run without any mask.
Only the tiles at the diagonal (and, with a window, at its lower edge) mask scores and loads. In the unmasked loop
each tile's block ids are loaded one iteration ahead, so K/V addresses do not wait on a load of their own iteration
and Triton's software pipeline gets num_stages K/V buffers (with the lookup in the same iteration it kept 2 whatever
num_stages; checked in the sm_90 TTGIR and shared-memory sizes).

Several sequences' chunks go in one launch: `PrefillPlan` lists (first row, rows, first position, table offset)
work items, heaviest (latest positions) first so the long programs do not form the tail, built once per forward
and shared by every layer of a KV group. The chunk's own K/V must already be in the cache (the layer writes them
before attending).

Tile shapes and launch options are `PrefillAttnTuning` (defaults, or $MEGAKERNEL_PREFILL_ATTN for measurements;
benchmarks/prefill_attention_tune.py times the alternatives on a GPU).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from megakernel.ops.common import INTERPRET, dot, pow2
from megakernel.transfer import to_device

LOG2E = math.log2(math.e)
ENV = "MEGAKERNEL_PREFILL_ATTN"


@dataclass(frozen=True)
class PrefillAttnTuning:
    """Launch shape of the prefill attention kernel."""

    block_n: int = 64          # keys per tile
    num_warps: int = 8
    num_stages: int = 2
    block_rows: int = 128      # rows per program: query tokens x the kv head's query heads (padded to a power of 2)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"PrefillAttnTuning.{f.name} must be a positive int, not {v!r}")
        for name in ("block_n", "num_warps", "block_rows"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"PrefillAttnTuning.{name} must be a power of two, not {v}")
        if self.block_n < 16:
            raise ValueError(f"PrefillAttnTuning.block_n must be >= 16 (tl.dot), not {self.block_n}")

    @classmethod
    def parse(cls, spec: str) -> "PrefillAttnTuning":
        """"block_n=128,num_warps=8,num_stages=3" (any subset; the rest keep their defaults)."""
        names = [f.name for f in fields(cls)]
        kw = {}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            name, eq, value = (x.strip() for x in item.partition("="))
            if name not in names or not eq:
                raise ValueError(f"{ENV}: bad setting {item!r} (name=value with name one of {', '.join(names)})")
            try:
                kw[name] = int(value)
            except ValueError:
                raise ValueError(f"{ENV}: {name} wants an integer, not {value!r}") from None
        return cls(**kw)

    def label(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


# Measured best on the H200 (benchmarks/prefill_attention_tune.py, 2026-12-01: ~505 TFLOP/s at 8K-256K against
# ~345 for the dataclass defaults); it needs 224 KiB of shared memory per block, so only GPUs with that much get it.
HOPPER_TUNING = dict(block_n=128, num_warps=8, num_stages=3, block_rows=128)
HOPPER_SMEM_BYTES = 227 * 1024


def _device_base() -> str:
    """The tuning a GPU's shared memory allows: HOPPER_TUNING on sm_90-class shared memory, else the defaults."""
    if INTERPRET or not torch.cuda.is_available():
        return ""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    smem = getattr(props, "shared_memory_per_block_optin", 0)
    if not smem:
        smem = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())["max_shared_mem"]
    if smem >= HOPPER_SMEM_BYTES:
        return ",".join(f"{k}={v}" for k, v in HOPPER_TUNING.items())
    return ""


@functools.cache
def default_tuning() -> PrefillAttnTuning:
    """The device's tuning (`_device_base`), overridden key by key by $MEGAKERNEL_PREFILL_ATTN (read once)."""
    return PrefillAttnTuning.parse(",".join(x for x in (_device_base(), os.environ.get(ENV, "")) if x))


@triton.jit
def _tile_blocks(table, tbl, start, tt, end, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block ids of the keys [start, start + BLOCK_N) (tiles start at multiples of BLOCK_N), 0 for keys >= end: one
    scalar when the tile lies in one block, else one per key."""
    if BS % BLOCK_N == 0:
        blk = tl.load(table + tbl + start // BS, mask=start < end, other=0)
    else:
        kpos = start + tt
        blk = tl.load(table + tbl + kpos // BS, mask=kpos < end, other=0)
    return blk


@triton.jit
def _attn_tile(blk, acc, m_i, l_i, qt, qpos, kv, stride_kv, start, lo, qmax, window, qk_scale, kvh, tt, dd, dm,
               NKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
               HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr):
    """One key tile [start, start + BLOCK_N), its block ids `blk` (`_tile_blocks`), into the online softmax.
    MASKED=False: every key of the tile is in [lo, qmax] and visible to every query row (no masks at all)."""
    kpos = start + tt
    if MASKED:
        kv_ok = (kpos >= lo) & (kpos <= qmax)
    blk = blk.to(tl.int64)
    addr = blk * (2 * stride_kv) + (kpos % BS) * (NKV * D) + kvh * D
    if D % 16 == 0:
        addr = tl.multiple_of(addr, 16)
    kp = kv + addr[:, None] + dd[None, :]
    if MASKED:
        lm = kv_ok[:, None] & dm[None, :]
        k = tl.load(kp, mask=lm, other=0.0)
        v = tl.load(kp + stride_kv, mask=lm, other=0.0)
    elif D == BLOCK_D:
        k = tl.load(kp)
        v = tl.load(kp + stride_kv)
    else:
        k = tl.load(kp, mask=dm[None, :], other=0.0)
        v = tl.load(kp + stride_kv, mask=dm[None, :], other=0.0)
    s = dot(qt, tl.trans(k), DOT_F32)
    if MASKED:
        vis = kv_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            vis = vis & ((qpos[:, None] - kpos[None, :]) < window)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)      # rows with no visible key yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        shift = m_new
    alpha = tl.math.exp2(m_i - shift)
    p = tl.math.exp2(s * qk_scale - shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(tl.bfloat16), v, DOT_F32)
    return acc, m_new, l_i


@triton.jit
def prefill_attn_kernel(q, q_stride, out, out_stride, kv, stride_kv, table, items, window, qk_scale,
                        NH: tl.constexpr, NKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                        BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    it = pid // NKV          # the kv heads of one item are neighbours: the heaviest items start first
    kvh = pid % NKV
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
    lo = 0              # the first key any row sees
    lo_all = 0          # the first key every row sees
    if HAS_WINDOW:
        lo = tl.maximum(pos0 - window + 1, 0)
        lo_all = tl.maximum(qmax - window + 1, 0)
    # [start_lo, a): the window's lower edge (masked); [a, b): visible to all rows; [b, qmax]: the diagonal
    start_lo = (lo // BLOCK_N) * BLOCK_N
    b = ((pos0 + 1) // BLOCK_N) * BLOCK_N
    a = tl.minimum(((lo_all + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, b)
    m_i = tl.full([BLOCK_M * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GP], tl.float32)
    acc = tl.zeros([BLOCK_M * GP, BLOCK_D], tl.float32)
    tt = tl.arange(0, BLOCK_N)
    if HAS_WINDOW:
        for start in range(start_lo, a, BLOCK_N):
            blk = _tile_blocks(table, tbl, start, tt, qmax + 1, BS, BLOCK_N)
            acc, m_i, l_i = _attn_tile(blk, acc, m_i, l_i, qt, qpos, kv, stride_kv, start, lo, qmax, window, qk_scale,
                                       kvh, tt, dd, dm, NKV, D, BS, BLOCK_D, True, HAS_WINDOW, DOT_F32)
    # the next tile's block ids are loaded one iteration ahead: K/V addresses that hang on a load of the same
    # iteration cost the software pipeline its depth (only 2 K/V buffers whatever num_stages)
    nxt = _tile_blocks(table, tbl, a, tt, b, BS, BLOCK_N)
    for start in range(a, b, BLOCK_N):
        blk = nxt
        nxt = _tile_blocks(table, tbl, start + BLOCK_N, tt, b, BS, BLOCK_N)
        acc, m_i, l_i = _attn_tile(blk, acc, m_i, l_i, qt, qpos, kv, stride_kv, start, lo, qmax, window, qk_scale,
                                   kvh, tt, dd, dm, NKV, D, BS, BLOCK_D, False, HAS_WINDOW, DOT_F32)
    for start in range(b, qmax + 1, BLOCK_N):
        blk = _tile_blocks(table, tbl, start, tt, qmax + 1, BS, BLOCK_N)
        acc, m_i, l_i = _attn_tile(blk, acc, m_i, l_i, qt, qpos, kv, stride_kv, start, lo, qmax, window, qk_scale,
                                   kvh, tt, dd, dm, NKV, D, BS, BLOCK_D, True, HAS_WINDOW, DOT_F32)
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out + ((row0 + tok).to(tl.int64) * out_stride + head)[:, None] + dd[None, :], res.to(tl.bfloat16),
             mask=rv[:, None] & dm[None, :])


@dataclass
class PrefillPlan:
    """Work items of one forward's prefill chunks in one KV group: (first row, rows, first position, offset of
    the sequence's block table in `table`), on the device, heaviest (latest last position) first."""

    items: torch.Tensor       # [n, 4] int32
    table: torch.Tensor       # flat int32 block tables of the chunks' sequences
    block_m: int


def rows_per_item(num_heads: int, num_kv_heads: int, tuning: PrefillAttnTuning | None = None) -> int:
    """Query tokens per program: `tuning.block_rows` rows of (token, query head of the kv head's group)."""
    tuning = tuning or default_tuning()
    return max(1, tuning.block_rows // pow2(num_heads // num_kv_heads, 1))


def plan_prefill(chunks: list[tuple[int, int, int, list[int]]], block_m: int, device: torch.device) -> PrefillPlan:
    """chunks: (first row in the flat batch, rows, first position, the sequence's block table in this group)."""
    items, flat = [], []
    for row0, n, pos0, table in chunks:
        off = len(flat)
        flat.extend(table)
        for i in range(0, n, block_m):
            items.append((row0 + i, min(block_m, n - i), pos0 + i, off))
    items.sort(key=lambda t: -(t[2] + t[1]))     # stable: ties keep the chunk order
    return PrefillPlan(to_device(items, torch.int32, device).view(-1, 4),
                       to_device([max(b, 0) for b in flat] or [0], torch.int32, device), block_m)


def prefill_attention(q: torch.Tensor, out: torch.Tensor, layer_kv: torch.Tensor, plan: PrefillPlan,
                      window: int | None, scale: float, tuning: PrefillAttnTuning | None = None) -> None:
    """q, out: [T, heads, head_dim] bf16, heads and head_dim contiguous (q may be a view into the QKV output);
    only the plan's rows of `out` are written. layer_kv: [blocks, 2, block_size, kv_heads, head_dim].
    Query tokens per program come from the plan (`rows_per_item` with the same tuning)."""
    T, nh, d = q.shape
    assert q.stride(2) == 1 and q.stride(1) == d and out.stride(2) == 1 and out.stride(1) == d
    nkv, bs = layer_kv.shape[3], layer_kv.shape[2]
    assert layer_kv.stride(1) == bs * nkv * d and layer_kv.stride(0) == 2 * layer_kv.stride(1)
    g = nh // nkv
    tuning = tuning or default_tuning()
    if plan.items.shape[0] == 0:
        return
    prefill_attn_kernel[(plan.items.shape[0] * nkv,)](
        q, q.stride(0), out, out.stride(0), layer_kv, layer_kv.stride(1), plan.table, plan.items, window or 0,
        scale * LOG2E, NH=nh, NKV=nkv, G=g, GP=pow2(g, 1), D=d, BS=bs, BLOCK_M=plan.block_m,
        BLOCK_N=tuning.block_n, BLOCK_D=pow2(d), HAS_WINDOW=bool(window), DOT_F32=INTERPRET,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages)


def prefill_attention_reference(q: torch.Tensor, layer_kv: torch.Tensor, table: list[int], pos: torch.Tensor,
                                window: int | None, scale: float) -> torch.Tensor:
    """fp32 attention of one sequence's queries q [n, heads, head_dim] at positions `pos` [n] over its paged keys
    (for tests and benchmarks; memory grows with n x keys, so pass a few rows at long context)."""
    n, nh, d = q.shape
    bs, nkv = layer_kv.shape[2], layer_kv.shape[3]
    pos = pos.to(q.device, torch.long)
    lo = 0 if not window else max(0, int(pos.min()) - window + 1)
    kpos = torch.arange(lo, int(pos.max()) + 1, device=q.device)
    blocks = torch.as_tensor(table, device=q.device, dtype=torch.long)[kpos // bs]
    k = layer_kv[blocks, 0, kpos % bs].float()                      # [S, kv_heads, d]
    v = layer_kv[blocks, 1, kpos % bs].float()
    qg = q.float().view(n, nkv, nh // nkv, d)
    s = torch.einsum("ngqd,sgd->gqns", qg, k) * scale
    keep = kpos[None, :] <= pos[:, None]
    if window:
        keep &= (pos[:, None] - kpos[None, :]) < window
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.einsum("gqns,sgd->ngqd", p, v).reshape(n, nh, d)
