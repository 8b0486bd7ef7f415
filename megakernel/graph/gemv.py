"""A dense projection for a few rows (out = x W^T + b) as one Triton kernel: each program owns BLOCK_N output
columns and streams their weight rows once. The alternative to cuBLAS for the decode step's QKV and output
projections (which one the backend uses is a measured choice: `GraphTuning.triton_gemv`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakernel.graph.common import INTERPRET, dot, pow2


@triton.jit
def gemv_kernel(x, x_stride, w, bias, out, out_stride, R, N, K, HAS_BIAS: tl.constexpr, BLOCK_B: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    nb = tl.program_id(0)
    bb = tl.arange(0, BLOCK_B)
    nn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    nm = nn < N
    wrow = w + nn[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        km = (k0 + kk) < K
        xt = tl.load(x + bb[:, None] * x_stride + (k0 + kk)[None, :], mask=(bb < R)[:, None] & km[None, :], other=0.0)
        wt = tl.load(wrow + (k0 + kk)[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        acc += dot(xt, tl.trans(wt), DOT_F32)
    if HAS_BIAS:
        acc += tl.load(bias + nn, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(out + bb[:, None] * out_stride + nn[None, :], acc.to(tl.bfloat16), mask=(bb < R)[:, None] & nm[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
         block_n: int = 16, block_k: int = 256, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x: [R, K] bf16 (R small), w: [N, K] bf16 -> [R, N] bf16, fp32 accumulation."""
    R, K = x.shape
    N = w.shape[0]
    if out is None:
        out = torch.empty(R, N, dtype=torch.bfloat16, device=x.device)
    gemv_kernel[(triton.cdiv(N, block_n),)](
        x, x.stride(0), w, bias if bias is not None else w, out, out.stride(0), R, N, K, HAS_BIAS=bias is not None,
        BLOCK_B=pow2(R), BLOCK_N=block_n, BLOCK_K=min(block_k, pow2(K)), DOT_F32=INTERPRET, num_warps=num_warps,
        num_stages=num_stages)
    return out
