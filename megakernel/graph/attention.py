"""Paged flash-decoding attention for one new token per sequence, with RoPE and the K/V append fused in.

`attn_decode_kernel` runs one program per (row, kv head, split). It reads the fused QKV projection's output,
rotates q (and the new k) when the layer uses RoPE, and attends over the cached keys of its share of the row's
visible range. The keys are read through the block table, which lives in device memory with the lengths, so one
captured graph serves any context. Split 0 also appends the new token's K/V to the cache and attends to the new
key from registers; the other splits read only older positions, so nothing races with that write. Each split
writes a partial output and its log-sum-exp; `attn_combine_kernel` merges them into the [row, heads * head_dim]
attention output.

Visible keys of a query at position p: k <= p and p - k < window (transformers' sliding mask).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakernel.ops.common import INTERPRET, dot, launch_opts, pdl_release, pdl_wait, pow2


@triton.jit
def _tile(kv, stride_kv, trow, base, kvh, t, t_start, lo, p, BS: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """K, V [BLOCK_T, BLOCK_D] of cached key tile t (positions before p only) and which positions are visible."""
    tt = tl.arange(0, BLOCK_T)
    dd = tl.arange(0, BLOCK_D)
    kpos = t_start + t * BLOCK_T + tt
    valid = (kpos >= lo) & (kpos < p)
    blk = tl.load(trow + kpos // BS - base, mask=valid, other=0).to(tl.int64)
    addr = blk * (2 * stride_kv) + (kpos % BS) * (NKV * D) + kvh * D
    lmask = valid[:, None] & (dd < D)[None, :]
    k = tl.load(kv + addr[:, None] + dd[None, :], mask=lmask, other=0.0)
    v = tl.load(kv + stride_kv + addr[:, None] + dd[None, :], mask=lmask, other=0.0)
    return k, v, valid


@triton.jit
def _attend(q, k, v, valid, m_i, l_i, acc, scale, DOT_F32: tl.constexpr):
    """One online-softmax update of (max, sum, output) with a tile of keys."""
    sc = dot(q, tl.trans(k), DOT_F32) * scale
    sc = tl.where(valid[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    alpha = tl.exp(m_i - m_new)
    pr = tl.exp(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    acc = acc * alpha[:, None] + dot(pr.to(tl.bfloat16), v, DOT_F32)
    return m_new, l_i, acc


@triton.jit
def attn_decode_kernel(qkv, qkv_stride, cos, sin, kv, stride_kv, table, table_stride, table_base,
                       pos_ptr, n_rows_ptr, part_o, part_lse, nsplit, window, scale,
                       NKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                       BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                       ROPE: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    pdl_release(PDL)
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    if r < tl.load(n_rows_ptr):
        p = tl.load(pos_ptr + r)
        lo = 0
        if window > 0:
            lo = tl.maximum(p - window + 1, 0)
        base = tl.load(table_base + r)
        trow = table + r.to(tl.int64) * table_stride
        # cached keys [lo, p) in tiles of BLOCK_T positions, tiles shared out between the splits
        t_start = (lo // BLOCK_T) * BLOCK_T
        n_tiles = tl.cdiv(p - t_start, BLOCK_T)
        per = tl.cdiv(n_tiles, nsplit)
        t0 = sp * per
        t1 = tl.minimum(t0 + per, n_tiles)
        # written by earlier steps: the first tile loads before the wait for this step's q, k, v
        k_first, v_first, valid_first = _tile(kv, stride_kv, trow, base, kvh, t0, t_start, lo, p, BS, NKV, D,
                                              BLOCK_T, BLOCK_D)
        pdl_wait(PDL)
        hg = tl.arange(0, BLOCK_G)
        dd = tl.arange(0, BLOCK_D)
        gm = hg < G
        dm = dd < D
        qrow = qkv + r.to(tl.int64) * qkv_stride
        qcol = (kvh * G + hg[:, None]) * D + dd[None, :]
        qmask = gm[:, None] & dm[None, :]
        q = tl.load(qrow + qcol, mask=qmask, other=0.0).to(tl.float32)
        kcol = NKV * G * D + kvh * D + dd
        k_new = tl.load(qrow + kcol, mask=dm, other=0.0).to(tl.float32)
        v_new = tl.load(qrow + kcol + NKV * D, mask=dm, other=0.0)
        if ROPE:    # interleaved pairs: out[2i] = x[2i] c - x[2i+1] s, out[2i+1] = x[2i+1] c + x[2i] s
            c = tl.load(cos + r * D + dd, mask=dm, other=0.0).to(tl.float32)
            s = tl.load(sin + r * D + dd, mask=dm, other=0.0).to(tl.float32)
            sgn = tl.where(dd % 2 == 0, -1.0, 1.0)
            q_pair = tl.load(qrow + (kvh * G + hg[:, None]) * D + (dd[None, :] ^ 1), mask=qmask,
                             other=0.0).to(tl.float32)
            q = q * c[None, :] + q_pair * (sgn * s)[None, :]
            k_pair = tl.load(qrow + NKV * G * D + kvh * D + (dd ^ 1), mask=dm, other=0.0).to(tl.float32)
            k_new = k_new * c + k_pair * (sgn * s)
        q = q.to(tl.bfloat16)
        k_new = k_new.to(tl.bfloat16)
        if sp == 0:
            blk = tl.load(trow + p // BS - base).to(tl.int64)
            dst = kv + blk * (2 * stride_kv) + (p % BS) * (NKV * D) + kvh * D + dd
            tl.store(dst, k_new, mask=dm)
            tl.store(dst + stride_kv, v_new, mask=dm)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        if t0 < t1:
            m_i, l_i, acc = _attend(q, k_first, v_first, valid_first, m_i, l_i, acc, scale, DOT_F32)
        for t in range(t0 + 1, t1):
            k, v, valid = _tile(kv, stride_kv, trow, base, kvh, t, t_start, lo, p, BS, NKV, D, BLOCK_T, BLOCK_D)
            m_i, l_i, acc = _attend(q, k, v, valid, m_i, l_i, acc, scale, DOT_F32)
        if sp == 0:     # the new key, from registers
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp(m_i - m_new)
            pn = tl.exp(s_new - m_new)
            l_i = l_i * alpha + pn
            acc = acc * alpha[:, None] + pn.to(tl.bfloat16).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
            m_i = m_new
        # partials of query head kvh * G + h at [row, kvh * G + h, split]: the combine reads one head's splits at once
        head = (r * NKV + kvh) * G + hg
        out = head.to(tl.int64) * nsplit + sp
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        tl.store(part_o + out[:, None] * D + dd[None, :], o, mask=gm[:, None] & dm[None, :])
        tl.store(part_lse + out, tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf")), mask=gm)


@triton.jit
def attn_combine_kernel(part_o, part_lse, out, out_stride, n_rows_ptr, nsplit, NH: tl.constexpr, D: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, query head): all its splits in one load, weighted by their log-sum-exp."""
    pdl_release(PDL)
    pdl_wait(PDL)
    r = tl.program_id(0)
    h = tl.program_id(1)
    if r < tl.load(n_rows_ptr):
        ss = tl.arange(0, BLOCK_S)
        dd = tl.arange(0, BLOCK_D)
        sm = ss < nsplit
        first = (r * NH + h).to(tl.int64) * nsplit
        lse = tl.load(part_lse + first + ss, mask=sm, other=float("-inf"))
        w = tl.exp(lse - tl.max(lse, axis=0))
        o = tl.load(part_o + (first + ss)[:, None] * D + dd[None, :], mask=sm[:, None] & (dd < D)[None, :],
                    other=0.0)
        res = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
        tl.store(out + r.to(tl.int64) * out_stride + h * D + dd, res.to(tl.bfloat16), mask=dd < D)


class DecodeAttention:
    """Shapes and scratch of the decode attention for one batch bucket; `__call__` enqueues both kernels."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, rows: int,
                 nsplit: int, device: torch.device, *, block_t: int = 64, num_warps: int = 4,
                 num_stages: int = 2, pdl: bool = False) -> None:
        self.nh, self.nkv, self.g, self.d, self.bs = num_heads, num_kv_heads, num_heads // num_kv_heads, head_dim, \
            block_size
        self.block_g, self.block_d = pow2(self.g), pow2(head_dim)
        self.block_t = pow2(block_t)            # keys per tile; a tile may span several KV blocks
        self.rows, self.nsplit = rows, nsplit
        self.num_warps, self.num_stages, self.pdl = num_warps, num_stages, pdl
        n = rows * num_heads * nsplit
        self.part_o = torch.empty(n * head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(n, dtype=torch.float32, device=device)
        self.scale = head_dim ** -0.5

    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_kv: torch.Tensor,
                 table: torch.Tensor, table_base: torch.Tensor, pos: torch.Tensor, n_rows: torch.Tensor,
                 window: int | None, rope: bool, out: torch.Tensor) -> None:
        """qkv: [rows, >= q + 2 kv] bf16; layer_kv: [blocks, 2, block_size, kv_heads, head_dim]; table: [rows, W]
        int32 block ids from block `table_base[row]` on; pos, n_rows: int32 on the device. Writes out [rows, q]."""
        self.splits(qkv, cos, sin, layer_kv, table, table_base, pos, n_rows, window, rope)
        self.combine(n_rows, out)

    def splits(self, qkv, cos, sin, layer_kv, table, table_base, pos, n_rows, window, rope) -> None:
        attn_decode_kernel[(self.rows, self.nkv, self.nsplit)](
            qkv, qkv.stride(0), cos, sin, layer_kv, layer_kv.stride(1), table, table.stride(0),
            table_base, pos, n_rows, self.part_o, self.part_lse, self.nsplit, window or 0, self.scale,
            NKV=self.nkv, G=self.g, D=self.d, BS=self.bs, BLOCK_G=self.block_g, BLOCK_D=self.block_d,
            BLOCK_T=self.block_t, ROPE=rope, DOT_F32=INTERPRET, PDL=self.pdl,
            **launch_opts(self.pdl, num_warps=self.num_warps, num_stages=self.num_stages))

    def combine(self, n_rows: torch.Tensor, out: torch.Tensor) -> None:
        attn_combine_kernel[(self.rows, self.nh)](
            self.part_o, self.part_lse, out, out.stride(0), n_rows, self.nsplit, NH=self.nh, D=self.d,
            BLOCK_S=pow2(self.nsplit, 1), BLOCK_D=self.block_d, PDL=self.pdl, **launch_opts(self.pdl, num_warps=4))
