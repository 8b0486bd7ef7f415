"""Residual add and norm in one pass: h = h + attention + MLP (the routed experts summed in ascending expert order,
each sum rounded to bf16, as the PyTorch path's index_add does), then x = norm(h) for the next layer.

Layer 0 instead gathers the embedding row. One program per batch row; rows past `n_rows` (bucket padding) are
left untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakernel.config import ModelConfig
from megakernel.ops.common import launch_opts, pdl_release, pdl_wait, pow2, rbf

MLP_NONE, MLP_DENSE, MLP_SHARED_SUM, MLP_SHARED_AVG = 0, 1, 2, 3


@triton.jit
def add_norm_kernel(h, ao, y, mlp, embed, ids, norm_w, x_out, n_rows_ptr, H, eps,
                    EMBED: tl.constexpr, HAS_Y: tl.constexpr, TOPK: tl.constexpr, MLP_KIND: tl.constexpr,
                    RMS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_release(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0)
    if row < tl.load(n_rows_ptr):
        offs = tl.arange(0, BLOCK_H)
        m = offs < H
        if EMBED:
            tok = tl.load(ids + row).to(tl.int64)
            hv = tl.load(embed + tok * H + offs, mask=m, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK_H], tl.float32)
            if HAS_Y:
                yrow = y + row * TOPK * H
                acc = tl.load(yrow + offs, mask=m, other=0.0).to(tl.float32)
                for k in tl.static_range(1, TOPK):
                    acc = rbf(acc + tl.load(yrow + k * H + offs, mask=m, other=0.0).to(tl.float32))
            if MLP_KIND == 1:
                acc = tl.load(mlp + row * H + offs, mask=m, other=0.0).to(tl.float32)
            elif MLP_KIND == 2:
                acc = rbf(acc + tl.load(mlp + row * H + offs, mask=m, other=0.0).to(tl.float32))
            elif MLP_KIND == 3:
                acc = rbf(rbf(acc + tl.load(mlp + row * H + offs, mask=m, other=0.0).to(tl.float32)) * 0.5)
            hp = tl.load(h + row * H + offs, mask=m, other=0.0).to(tl.float32)
            a = tl.load(ao + row * H + offs, mask=m, other=0.0).to(tl.float32)
            hv = rbf(rbf(hp + a) + acc)
        tl.store(h + row * H + offs, hv.to(tl.bfloat16), mask=m)
        w = tl.load(norm_w + offs, mask=m, other=0.0).to(tl.float32)
        if RMS:
            r = 1.0 / tl.sqrt(tl.sum(hv * hv, axis=0) / H + eps)
            xv = w * rbf(hv * r)
        else:
            mean = tl.sum(hv, axis=0) / H
            d = tl.where(m, hv - mean, 0.0)
            r = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / H + eps)
            xv = w * (d * r)
        tl.store(x_out + row * H + offs, xv.to(tl.bfloat16), mask=m)


def add_norm(cfg: ModelConfig, h: torch.Tensor, x_out: torch.Tensor, norm_w: torch.Tensor, n_rows: torch.Tensor,
             *, attn_out: torch.Tensor | None = None, y: torch.Tensor | None = None, mlp: torch.Tensor | None = None,
             mlp_kind: int = MLP_NONE, embed: torch.Tensor | None = None, ids: torch.Tensor | None = None,
             pdl: bool = False) -> None:
    """In place on `h` [Bp, H]: h = embed[ids] (when `embed` is given) or h + attn_out + MLP; x_out = norm(h).

    y: [Bp, topk, H] expert outputs by rank (ascending expert id); mlp: [Bp, H] dense or shared-expert output.
    """
    Bp, H = h.shape
    dummy = h
    add_norm_kernel[(Bp,)](
        h, attn_out if attn_out is not None else dummy, y if y is not None else dummy,
        mlp if mlp is not None else dummy, embed if embed is not None else dummy,
        ids if ids is not None else n_rows, norm_w, x_out, n_rows, H, cfg.norm_eps,
        EMBED=embed is not None, HAS_Y=y is not None, TOPK=cfg.num_experts_per_tok, MLP_KIND=mlp_kind,
        RMS=cfg.norm_type == "rms", BLOCK_H=pow2(H), PDL=pdl, **launch_opts(pdl, num_warps=4 if H <= 2048 else 8))
