"""A dense projection for a few rows (out = x W^T + b) as one Triton kernel: each program owns BLOCK_N output
columns and streams their weight rows once. With PDL the first PREFETCH weight tiles are loaded before the wait for
x, so they stream while the kernel before finishes. The backend's QKV and output projections run on it or on cuBLAS
(`GraphTuning.triton_gemv`, a measured choice)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakernel.ops.common import INTERPRET, dot, launch_opts, pdl_release, pdl_wait, pow2


@triton.jit
def gemv_kernel(x, x_stride, w, bias, out, out_stride, R, N, K, HAS_BIAS: tl.constexpr, BLOCK_B: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, DOT_F32: tl.constexpr,
                PDL: tl.constexpr):
    pdl_release(PDL)
    nb = tl.program_id(0)
    bb = tl.arange(0, BLOCK_B)
    nn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    nm = nn < N
    rm = bb < R
    wrow = w + nn[:, None].to(tl.int64) * K
    w0 = tl.load(wrow + kk[None, :], mask=nm[:, None] & (kk < K)[None, :], other=0.0)   # weights: before the wait
    if PREFETCH > 1:
        w1 = tl.load(wrow + (BLOCK_K + kk)[None, :], mask=nm[:, None] & ((BLOCK_K + kk) < K)[None, :], other=0.0)
    pdl_wait(PDL)
    xt = tl.load(x + bb[:, None] * x_stride + kk[None, :], mask=rm[:, None] & (kk < K)[None, :], other=0.0)
    acc = dot(xt, tl.trans(w0), DOT_F32)
    if PREFETCH > 1:
        xt = tl.load(x + bb[:, None] * x_stride + (BLOCK_K + kk)[None, :],
                     mask=rm[:, None] & ((BLOCK_K + kk) < K)[None, :], other=0.0)
        acc += dot(xt, tl.trans(w1), DOT_F32)
    for k0 in range(PREFETCH * BLOCK_K, K, BLOCK_K):
        km = (k0 + kk) < K
        xt = tl.load(x + bb[:, None] * x_stride + (k0 + kk)[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        wt = tl.load(wrow + (k0 + kk)[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        acc += dot(xt, tl.trans(wt), DOT_F32)
    if HAS_BIAS:
        acc += tl.load(bias + nn, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(out + bb[:, None] * out_stride + nn[None, :], acc.to(tl.bfloat16), mask=rm[:, None] & nm[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
         block_n: int = 16, block_k: int = 512, num_warps: int = 4, num_stages: int = 4, prefetch: int = 2,
         pdl: bool = False) -> torch.Tensor:
    """x: [R, K] bf16 (R small), w: [N, K] bf16 -> [R, N] bf16, fp32 accumulation."""
    R, K = x.shape
    N = w.shape[0]
    if out is None:
        out = torch.empty(R, N, dtype=torch.bfloat16, device=x.device)
    bk = min(block_k, pow2(K))
    gemv_kernel[(triton.cdiv(N, block_n),)](
        x, x.stride(0), w, bias if bias is not None else w, out, out.stride(0), R, N, K, HAS_BIAS=bias is not None,
        BLOCK_B=pow2(R), BLOCK_N=block_n, BLOCK_K=bk, PREFETCH=min(prefetch, triton.cdiv(K, bk)), DOT_F32=INTERPRET,
        PDL=pdl, **launch_opts(pdl, num_warps=num_warps, num_stages=num_stages))
    return out
