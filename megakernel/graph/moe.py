"""Routed experts for a decode batch, with no host sync and no copies of expert weights.

Both kernels start by routing every row (top-k of the router logits, then the configured scores) inside each
program: the logits are a few KB, so recomputing them is cheaper than another launch, and both kernels derive
the same routing from the same logits. Program (a, n) then serves the a-th distinct expert chosen by the batch
(ascending id; programs past the number of distinct experts exit at once) and a tile of its output rows, for every
row that chose it: each routed expert's weights are read in place, once per step.

Activations and outputs are indexed by (row, rank), rank = the expert's position among the row's experts in
ascending id order, so the residual add sums them in the order the PyTorch path's index_add does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakernel.config import ModelConfig
from megakernel.ops.common import INTERPRET, dot, launch_opts, pdl_release, pdl_wait, pow2, rbf


@triton.jit
def _route(logits, logit_stride, n_rows, E, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr, TOPK: tl.constexpr,
           SOFTMAX: tl.constexpr, RENORM: tl.constexpr):
    """(chosen [B, E] int32 0/1, score [B, E] fp32 rounded to bf16 where chosen, else 0)."""
    bb = tl.arange(0, BLOCK_B)
    ee = tl.arange(0, BLOCK_E)
    rv = bb < n_rows
    lg = tl.load(logits + bb[:, None] * logit_stride + ee[None, :], mask=rv[:, None] & (ee < E)[None, :],
                 other=float("-inf")).to(tl.float32)
    work = lg
    chosen = tl.zeros([BLOCK_B, BLOCK_E], tl.int32)
    for _ in tl.static_range(TOPK):     # largest first; ties to the smaller expert id
        mx = tl.max(work, axis=1)
        idx = tl.min(tl.where(work == mx[:, None], ee[None, :], BLOCK_E), axis=1)
        hit = ee[None, :] == idx[:, None]
        chosen = tl.where(hit, 1, chosen)
        work = tl.where(hit, float("-inf"), work)
    chosen = tl.where(rv[:, None], chosen, 0)
    sel = chosen != 0
    if SOFTMAX:
        top = tl.max(tl.where(sel, lg, float("-inf")), axis=1)
        top = tl.where(top > float("-inf"), top, 0.0)           # rows that chose nothing (padding)
        ex = tl.where(sel, tl.exp(tl.where(sel, lg, 0.0) - top[:, None]), 0.0)
        score = rbf(ex / tl.maximum(tl.sum(ex, axis=1), 1e-30)[:, None])
    else:
        score = tl.where(sel, rbf(1.0 / (1.0 + tl.exp(-lg))), 0.0)
        if RENORM:
            total = rbf(tl.sum(score, axis=1))
            score = rbf(score / tl.where(total > 0, total, 1.0)[:, None])
    return chosen, score


@triton.jit
def _expert_of_program(chosen, score, a, BLOCK_E: tl.constexpr):
    """The a-th distinct chosen expert (ascending), whether it exists, and per row: chose it, rank, weight."""
    ee = tl.arange(0, BLOCK_E)
    active = (tl.sum(chosen, axis=0) > 0).to(tl.int32)
    slot = tl.cumsum(active, axis=0) - 1
    n_active = tl.sum(active, axis=0)
    e = tl.sum(tl.where((active > 0) & (slot == a), ee, 0), axis=0)
    col = ee[None, :] == e
    rows = tl.sum(tl.where(col, chosen, 0), axis=1) > 0
    rank = tl.sum(tl.where(col, tl.cumsum(chosen, axis=1) - chosen, 0), axis=1)
    weight = tl.sum(tl.where(col, score, 0.0), axis=1)
    return a < n_active, e, rows, rank, weight


@triton.jit
def moe_gate_up_kernel(logits, logit_stride, x, x_stride, w_gu, act, topk_out, n_rows_ptr, E, H, I,
                       BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr, TOPK: tl.constexpr, SOFTMAX: tl.constexpr,
                       RENORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                       PDL: tl.constexpr):
    pdl_release(PDL)
    pdl_wait(PDL)
    a = tl.program_id(0)
    nb = tl.program_id(1)
    n_rows = tl.load(n_rows_ptr)
    chosen, score = _route(logits, logit_stride, n_rows, E, BLOCK_B, BLOCK_E, TOPK, SOFTMAX, RENORM)
    bb = tl.arange(0, BLOCK_B)
    if (a == 0) & (nb == 0):            # the chosen ids, in rank order, for traces and benchmarks
        ee = tl.arange(0, BLOCK_E)
        rank_all = tl.cumsum(chosen, axis=1) - chosen
        for k in tl.static_range(TOPK):
            ek = tl.sum(tl.where((chosen != 0) & (rank_all == k), ee[None, :], 0), axis=1)
            tl.store(topk_out + bb * TOPK + k, ek, mask=bb < n_rows)
    exists, e, rows, rank, weight = _expert_of_program(chosen, score, a, BLOCK_E)
    if exists:
        nn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = nn < I
        kk = tl.arange(0, BLOCK_K)
        wg = w_gu + e.to(tl.int64) * (2 * I * H) + nn[:, None].to(tl.int64) * H
        wu = wg + I * H
        acc_g = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            km = (k0 + kk) < H
            xt = tl.load(x + bb[:, None] * x_stride + (k0 + kk)[None, :], mask=rows[:, None] & km[None, :],
                         other=0.0)
            wmask = nm[:, None] & km[None, :]
            g = tl.load(wg + (k0 + kk)[None, :], mask=wmask, other=0.0)
            u = tl.load(wu + (k0 + kk)[None, :], mask=wmask, other=0.0)
            acc_g += dot(xt, tl.trans(g), DOT_F32)
            acc_u += dot(xt, tl.trans(u), DOT_F32)
        gate = rbf(acc_g)
        out = rbf(gate / (1.0 + tl.exp(-gate))) * rbf(acc_u)
        dst = act + ((bb * TOPK + rank).to(tl.int64) * I)[:, None] + nn[None, :]
        tl.store(dst, out.to(tl.bfloat16), mask=rows[:, None] & nm[None, :])


@triton.jit
def moe_down_kernel(logits, logit_stride, act, w_dn, y, n_rows_ptr, E, H, I,
                    BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr, TOPK: tl.constexpr, SOFTMAX: tl.constexpr,
                    RENORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_release(PDL)
    pdl_wait(PDL)
    a = tl.program_id(0)
    nb = tl.program_id(1)
    n_rows = tl.load(n_rows_ptr)
    chosen, score = _route(logits, logit_stride, n_rows, E, BLOCK_B, BLOCK_E, TOPK, SOFTMAX, RENORM)
    exists, e, rows, rank, weight = _expert_of_program(chosen, score, a, BLOCK_E)
    if exists:
        bb = tl.arange(0, BLOCK_B)
        nn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = nn < H
        kk = tl.arange(0, BLOCK_K)
        wd = w_dn + e.to(tl.int64) * (H * I) + nn[:, None].to(tl.int64) * I
        src = act + ((bb * TOPK + rank).to(tl.int64) * I)[:, None]
        acc = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            km = (k0 + kk) < I
            xt = tl.load(src + (k0 + kk)[None, :], mask=rows[:, None] & km[None, :], other=0.0)
            w = tl.load(wd + (k0 + kk)[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc += dot(xt, tl.trans(w), DOT_F32)
        out = rbf(rbf(acc) * weight[:, None])
        dst = y + ((bb * TOPK + rank).to(tl.int64) * H)[:, None] + nn[None, :]
        tl.store(dst, out.to(tl.bfloat16), mask=rows[:, None] & nm[None, :])


class DecodeMoE:
    """Tile shapes and scratch of the routed experts for one batch bucket (`rows` padded rows at most)."""

    def __init__(self, cfg: ModelConfig, rows: int, device: torch.device, *, gu_block_n: int = 64,
                 dn_block_n: int = 64, gu_block_k: int = 128, dn_block_k: int = 128, num_warps: int = 4,
                 gu_stages: int = 4, dn_stages: int = 3, pdl: bool = False) -> None:
        self.cfg, self.rows = cfg, rows
        self.E, self.K, self.H, self.I = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, \
            cfg.moe_intermediate_size
        self.block_b, self.block_e = pow2(rows), pow2(self.E, 16)
        self.n_prog = min(self.E, rows * self.K)          # distinct experts one step can route to, at most
        self.gu_bn = min(gu_block_n, pow2(self.I))
        self.dn_bn = min(dn_block_n, pow2(self.H))
        self.gu_bk = min(gu_block_k, pow2(self.H))
        self.dn_bk = min(dn_block_k, pow2(self.I))
        self.num_warps, self.gu_stages, self.dn_stages, self.pdl = num_warps, gu_stages, dn_stages, pdl
        self.act = torch.empty(rows * self.K * self.I, dtype=torch.bfloat16, device=device)
        self.softmax = cfg.expert_selection_fn == "softmax"
        self.renorm = cfg.norm_topk_prob and not self.softmax

    def __call__(self, router_logits: torch.Tensor, x: torch.Tensor, w_gu: torch.Tensor, w_dn: torch.Tensor,
                 n_rows: torch.Tensor, y: torch.Tensor, topk_out: torch.Tensor) -> None:
        """router_logits: [rows, >= E] (a view into the QKV output); x: [rows, H]; writes y [rows, topk, H]
        (rows that did not choose an expert at some rank are not written) and topk_out [rows, topk]."""
        self.gate_up(router_logits, x, w_gu, n_rows, topk_out)
        self.down(router_logits, w_dn, n_rows, y)

    def _common(self, stages: int) -> dict:
        return dict(BLOCK_B=self.block_b, BLOCK_E=self.block_e, TOPK=self.K, SOFTMAX=self.softmax,
                    RENORM=self.renorm, DOT_F32=INTERPRET, PDL=self.pdl,
                    **launch_opts(self.pdl, num_warps=self.num_warps, num_stages=stages))

    def gate_up(self, router_logits, x, w_gu, n_rows, topk_out) -> None:
        moe_gate_up_kernel[(self.n_prog, triton.cdiv(self.I, self.gu_bn))](
            router_logits, router_logits.stride(0), x, x.stride(0), w_gu, self.act, topk_out, n_rows,
            self.E, self.H, self.I, BLOCK_N=self.gu_bn, BLOCK_K=self.gu_bk, **self._common(self.gu_stages))

    def down(self, router_logits, w_dn, n_rows, y) -> None:
        moe_down_kernel[(self.n_prog, triton.cdiv(self.H, self.dn_bn))](
            router_logits, router_logits.stride(0), self.act, w_dn, y, n_rows, self.E, self.H, self.I,
            BLOCK_N=self.dn_bn, BLOCK_K=self.dn_bk, **self._common(self.dn_stages))
