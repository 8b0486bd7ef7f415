"""CPU (or any-device) executor of the megakernel's task list, with PyTorch ops implementing each task.

It runs the *same* records the GPU kernel runs, one task at a time, in a random order that respects only the
declared dependencies (counters and targets in the records; inside MOE_WORKER tasks the per-expert waits), and
checks that no task reads a buffer element (scratch, attention partials, the new token's K/V) before a task wrote
it in this step. A missing dependency edge therefore shows up as `ReadBeforeWrite` for some seed, and a cycle or
wrong target as `SimDeadlock`, without a GPU. Every task mirrors the kernel's numerics (the casts to the
activation dtype sit at the same places), so with fp32 weights the logits match the PyTorch decode step to
fp32 rounding.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from megakernel.kernel import opcodes as O
from megakernel.kernel.plan import ModelPlan
from megakernel.kernel.schedule import StepInputs, TaskList
from megakernel.kv.cache import KVCache
from megakernel.model import layers as Lyr
from megakernel.model.weights import ModelWeights

Op = O.Op


def _o_start(p, n_gu: int) -> int:
    """The first O item of a layer's queue (o_queue plans): after the gate/up items and o_after eighths of the down
    items (csrc/mk_moe.cuh o_queue_start)."""
    return n_gu + (n_gu // p.gu_tiles * p.dn_tiles * p.o_after >> 3)

def queue_kind(n_slots: int, G: int, D: int, lag: int, item: int) -> tuple[bool, int, int]:
    """(down, slot, tile) of item `item` of a MoE layer's queue without O items: n_slots experts' G gate/up items
    each, then (lag 0) their D down items each; with lag > 0 the down items of slot s follow the gate/up items of
    slot s + lag (those of the last `lag` slots after every gate/up item). A down item's gate/up items always come
    earlier. The lag is at most half the slots (a lag past them would put every down item last), and 0 under
    DN_LAG_MIN. (csrc/mk_moe.cuh queue_kind is the same formula.)"""
    lag = min(lag, n_slots // 2)
    if lag < O.DN_LAG_MIN:
        lag = 0
    if lag <= 0 or lag >= n_slots:
        return (False, *divmod(item, G)) if item < n_slots * G else (True, *divmod(item - n_slots * G, D))
    head = lag * G                           # slots 0 .. lag-1: gate/up only
    if item < head:
        return (False, *divmod(item, G))
    mid = (n_slots - lag) * (G + D)          # slots lag .. n_slots-1: gate/up of k, then down of k - lag
    if item < head + mid:
        k, r = divmod(item - head, G + D)
        return (False, k + lag, r) if r < G else (True, k, r - G)
    s, t = divmod(item - head - mid, D)      # the last lag slots' down items
    return True, n_slots - lag + s, t


class ReadBeforeWrite(AssertionError):
    pass


class SimDeadlock(AssertionError):
    pass


@dataclass
class SimResult:
    logits: torch.Tensor          # [B, V] fp32
    tokens: torch.Tensor          # [B] greedy choice
    experts: list[torch.Tensor]   # per MoE layer [B, top_k]
    order: list[int]              # task indices in the order they finished


class Simulator:
    def __init__(self, plan: ModelPlan, weights: ModelWeights, claims_held: int = 1) -> None:
        """claims_held: MoE items a worker holds claimed at once, the one it runs included (1: it claims the next
        item when it finishes one). The paged worker claims its next item before the current one ends
        (MK_PG_CLAIM_LEAD: two held while the first waits for its inputs); the no-deadlock argument
        (mk_moe_pages.cuh) says any number is safe while each worker claims in queue order and runs its items in
        claim order, which the random orders here check."""
        if claims_held < 1:
            raise ValueError(f"claims_held={claims_held}: a worker holds at least the item it runs")
        self.plan = plan
        self.claims_held = claims_held
        self.w = weights
        self.act = weights.dtype
        self.dev = weights.device
        cfg = plan.cfg
        self.scale = cfg.head_dim ** -0.5
        self.inv_freq = Lyr.rope_inv_freq(cfg)

    # ---- buffers with write tracking ---------------------------------------------------------------------------
    def _alloc(self, n_partials: int, B: int) -> None:
        p = self.plan
        self.buf: dict[str, torch.Tensor] = {}
        self.mask: dict[str, torch.Tensor] = {}
        spec = p.scratch_spec(self.act)
        spec["part_o"] = ((max(1, n_partials), p.g, p.d), torch.float32)
        spec["part_lse"] = ((max(1, n_partials), p.g), torch.float32)
        spec["logits"] = ((p.max_batch, p.cfg.vocab_size), torch.float32)
        for name, (shape, dt) in spec.items():
            t = torch.empty(shape, dtype=dt, device=self.dev)
            if dt.is_floating_point:
                t.fill_(float("nan"))
            else:
                t.fill_(-777)
            self.buf[name] = t
            self.mask[name] = torch.zeros(shape, dtype=torch.bool, device=self.dev)

    def rd(self, name: str, idx) -> torch.Tensor:
        if not bool(self.mask[name][idx].all()):
            raise ReadBeforeWrite(f"task {self.cur} ({self.cur_op}) reads {name}[{idx}] before it was written")
        return self.buf[name][idx]

    def wr(self, name: str, idx, val) -> None:
        self.buf[name][idx] = val
        self.mask[name][idx] = True

    # ---- step inputs ----------------------------------------------------------------------------------------------
    def _decode_inputs(self, si: StepInputs) -> None:
        p = self.plan
        Bm, G = p.max_batch, p.n_groups
        st = si.step
        self.ids = st[:si.B].tolist()
        self.pos = st[Bm:Bm + si.B].tolist()
        self.toff = st[2 * Bm:2 * Bm + Bm * G].reshape(Bm, G)
        self.tbase = st[2 * Bm + Bm * G:2 * Bm + 2 * Bm * G].reshape(Bm, G)
        self.tables = si.tables
        self.S = si.split_tokens

    def _slot(self, s: int, g: int, key_pos: int) -> tuple[int, int]:
        bs = self.plan.layout.block_size
        blk = int(self.tables[int(self.toff[s, g]) + key_pos // bs - int(self.tbase[s, g])])
        return blk, key_pos % bs

    def _cos_sin(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.tensor([self.pos[s]], device=self.dev)
        return Lyr.rope_cos_sin(pos, self.plan.cfg, self.act)

    # ---- run ------------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, si: StepInputs, tl: TaskList, cache: KVCache, seed: int = 0) -> SimResult:
        p = self.plan
        self.cache = cache
        self.B = si.B
        self._decode_inputs(si)
        self._alloc(tl.n_partials, si.B)
        self.counters = np.zeros(p.n_counters, dtype=np.int64)
        self.moe_work = np.zeros(max(1, p.Lm), dtype=np.int64)
        self.early_claim: dict[int, int] = {}    # worker task -> the item it claimed before its wait
        self.kv_written: dict[tuple[int, int], torch.Tensor] = {}
        for l in range(p.L):
            for s in range(si.B):
                self.kv_written[(l, s)] = torch.zeros(2, p.nkv, p.d, dtype=torch.bool)
        rng = random.Random(seed)
        rec = tl.records
        # scheduler: generators blocked on (counter, target)
        ready: list[tuple[int, object]] = []
        blocked: dict[int, list[tuple[int, int, object]]] = {}
        order: list[int] = []
        n_live = 0

        def advance(i: int, gen) -> None:
            nonlocal n_live
            self.cur, self.cur_op = i, Op(int(rec[i, O.R["op"]])).name
            try:
                c, t = next(gen)
            except StopIteration:
                n_live -= 1
                order.append(i)
                return
            park(i, gen, c, t)

        def park(i, gen, c, t):
            if self.counters[c] >= t:
                ready.append((i, gen))
            else:
                blocked.setdefault(c, []).append((i, t, gen))

        def wake(c: int) -> None:
            lst = blocked.get(c)
            if not lst:
                return
            keep = []
            for i, t, gen in lst:
                if self.counters[c] >= t:
                    ready.append((i, gen))
                else:
                    keep.append((i, t, gen))
            blocked[c] = keep

        self._sched_wake = wake
        for i in range(len(rec)):
            n_live += 1
            ready.append((i, self._task(i, rec[i])))
        while ready:
            k = rng.randrange(len(ready))
            ready[k], ready[-1] = ready[-1], ready[k]
            i, gen = ready.pop()
            advance(i, gen)
        if n_live:
            # the earliest blocked task in list order is the root cause; report it first
            stuck = sorted((i, c, t) for c, v in blocked.items() for i, t, _ in v)
            desc = "; ".join(f"task {i} ({Op(int(rec[i, 0])).name}) waits for {t} on counter {c} "
                             f"({tl.names.get(c, '?')}) at {int(self.counters[c])}" for i, c, t in stuck[:5])
            raise SimDeadlock(f"{n_live} tasks cannot run: {desc}")
        B = si.B
        logits = self.rd("logits", (slice(0, B),)).clone()
        tokens = self.rd("tokens", (slice(0, B),)).clone()
        experts = []
        for m in range(p.Lm):
            ids = self.buf["route"][m, p.r_topk_ids:p.r_topk_ids + p.n_pairs].view(p.max_batch, p.topk)[:B]
            experts.append(ids.clone().long())
        return SimResult(logits=logits, tokens=tokens, experts=experts, order=order)

    def _task(self, i: int, r: np.ndarray):
        """Generator: yields (counter, target) waits, runs the body, signals."""
        op = int(r[O.R["op"]])
        waits = [(int(r[O.R[f"w{k}c"]]), int(r[O.R[f"w{k}t"]])) for k in range(O.MAX_WAITS)
                 if int(r[O.R[f"w{k}c"]]) >= 0]
        l, a0, a1, a2, a3 = (int(r[O.R[k]]) for k in ("layer", "a0", "a1", "a2", "a3"))
        if op == Op.MOE_WORKER and self.plan.worker_claim_early and not self.plan.worker_topk:
            self.early_claim[i] = self._claim(a0)    # (the kernel's thread 0, before its wait for the routing)
        for w in waits:
            yield w
        body = {
            Op.NORM: self.t_norm, Op.QKV: self.t_qkv, Op.ATTN: self.t_attn, Op.ATTN_COMBINE: self.t_combine,
            Op.OPROJ: self.t_oproj, Op.ROUTER: self.t_router, Op.TOPK: self.t_topk,
            Op.MOE_WORKER: self.t_worker, Op.MLP_GU: self.t_mlp_gu, Op.MLP_DOWN: self.t_mlp_down,
            Op.LM_HEAD: self.t_lm, Op.ARGMAX: self.t_argmax,
        }[Op(op)]
        self.cur_flags = int(r[O.R["flags"]])
        res = body(l, a0, a1, a2, a3)
        if res is not None:            # generator bodies (MOE_WORKER) wait inside
            yield from res
        sig = int(r[O.R["sig"]])
        if sig >= 0:
            self._wake(sig)
        if op == Op.ROUTER and a3 > 0 and self.counters[sig] == a3:
            # router_topk: this tile completed the router counter (the kernel's acq_rel add returned a3 - 1), so it
            # routes the layer and signals the top-k counter
            self.wr("route", (self.plan.moe_idx[l],), self._route(self.plan.moe_idx[l]))
            self._wake(a2)

    def _wake(self, c: int) -> None:
        self.counters[c] += 1
        # move newly satisfied generators to ready: done lazily by the scheduler through `blocked`
        sched = self._sched_wake
        sched(c)

    # The scheduler's wake function is installed per step (closure over ready/blocked).
    def _sched_wake(self, c: int) -> None:  # replaced in step()
        raise NotImplementedError

    # ---- tasks ----------------------------------------------------------------------------------------------------
    def _norm_w(self, l: int) -> torch.Tensor:
        return self.w.final_norm if l == self.plan.L else self.w.layers[l].norm_weight

    def t_norm(self, l, row, *_):
        h = self.w.embed[self.ids[row]].clone() if l == 0 else self._residual(l, row)
        self.wr("h", (l, row), h)
        self.wr("x", (l, row), Lyr.norm(h[None], self._norm_w(l), self.plan.cfg)[0])

    def _x_in(self, l: int) -> torch.Tensor:
        """The normed input rows of layer l for a QKV / router / MLP gate-up tile: read from x, or (FLAG_FUSED_NORM)
        computed from the residual inputs, with the tile's FLAG_WRITE_H / FLAG_WRITE_X writes."""
        flags = self.cur_flags
        if not flags & O.FLAG_FUSED_NORM:
            return self.rd("x", (l, slice(0, self.B)))
        rows = []
        for row in range(self.B):
            h = self._residual(l, row)
            x = Lyr.norm(h[None], self._norm_w(l), self.plan.cfg)[0]
            if flags & O.FLAG_WRITE_H:
                self.wr("h", (l, row), h)
            if flags & O.FLAG_WRITE_X:
                self.wr("x", (l, row), x)
            rows.append(x)
        return torch.stack(rows)

    def _residual(self, l: int, row: int) -> torch.Tensor:
        """The residual stream of `row` entering layer l >= 1: h, attention out and MLP out of layer l - 1."""
        p, cfg = self.plan, self.plan.cfg
        lp = l - 1
        hp = self.rd("h", (lp, row))
        a = self.rd("ao", (lp, row))
        kind = p.mlp_kind[lp]
        out = None
        if lp in p.moe_idx:
            m = p.moe_idx[lp]
            out = self.rd("y", (m, row, 0)).clone()
            for k in range(1, p.topk):
                out = out + self.rd("y", (m, row, k))
        if kind == O.MLP_DENSE:
            out = self.rd("mout", (lp, row))
        elif kind == O.MLP_SHARED:
            sh = self.rd("mout", (lp, row))
            out = out + sh if cfg.shared_expert_combination == "sum" else (out + sh) / 2
        return hp + a + out

    def t_qkv(self, l, r0, nr, *_):
        p, cfg = self.plan, self.plan.cfg
        B, d, Q, KV = self.B, p.d, p.Q, p.KV
        lw = self.w.layers[l]
        x = self._x_in(l)
        bias = lw.qkv_bias[r0:r0 + nr] if lw.qkv_bias is not None else None
        out = F.linear(x, lw.qkv[r0:r0 + nr], bias)                     # [B, nr]
        dd0 = (r0 if r0 < Q else (r0 - Q) % KV) % d
        dd = (dd0 + torch.arange(nr, device=self.dev)) % d   # (a Q tile may span two query heads: schedule.qkv_tiles)
        if cfg.uses_rope(l) and r0 < Q + KV:
            rows = []
            for s in range(B):
                cos, sin = self._cos_sin(s)
                c, sn = cos[0, dd].float(), sin[0, dd].float()
                xf = out[s].float()
                rot = torch.stack([-xf[1::2], xf[0::2]], dim=-1).flatten()
                rows.append((xf * c + rot * sn).to(out.dtype))
            out = torch.stack(rows)
        if r0 < Q:
            assert r0 // (p.g * d) == (r0 + nr - 1) // (p.g * d), "a Q tile stays inside one kv head's query heads"
            self.wr("q", (l, slice(0, B), slice(r0, r0 + nr)), out)
            return
        which = 0 if r0 < Q + KV else 1
        kvh = ((r0 - Q) % KV) // d
        assert dd0 + nr <= d, "a K or V tile stays inside its kv head"
        g, layer_kv = self.cache.layer(l)
        for s in range(B):
            blk, off = self._slot(s, g, self.pos[s])
            layer_kv[blk, which, off, kvh, dd0:dd0 + nr] = out[s]
            self.kv_written[(l, s)][which, kvh, dd0:dd0 + nr] = True

    def _range(self, l: int, s: int) -> tuple[int, int]:
        w = self.plan.cfg.window_for(l)
        p = self.pos[s]
        return (0 if w is None else max(0, p - w + 1)), p + 1

    def t_attn(self, l, s, kvh, j, pbase):
        p = self.plan
        g, d = p.g, p.d
        lo, hi = self._range(l, s)
        k0 = lo + j * self.S
        k1 = min(hi, k0 + self.S)
        assert k0 < k1, "empty attention split"
        if k1 == hi and not bool(self.kv_written[(l, s)][:, kvh].all()):
            raise ReadBeforeWrite(f"task {self.cur} (ATTN) reads the new K/V of layer {l} seq {s} head {kvh} "
                                  f"before it was written")
        q = self.rd("q", (l, s, slice(kvh * g * d, (kvh + 1) * g * d))).float().view(g, d)
        grp, layer_kv = self.cache.layer(l)
        slots = [self._slot(s, grp, t) for t in range(k0, k1)]
        blk = torch.tensor([b for b, _ in slots])
        off = torch.tensor([o for _, o in slots])
        k = layer_kv[blk, 0, off, kvh].float()                            # [n, d]
        v = layer_kv[blk, 1, off, kvh].float()
        sc = (q @ k.T) * self.scale                                       # [g, n]
        m = sc.max(dim=1).values
        e = torch.exp(sc - m[:, None])
        lsum = e.sum(dim=1)
        o = (e @ v) / lsum[:, None]
        self.wr("part_o", (pbase + j,), o)
        self.wr("part_lse", (pbase + j,), m + torch.log(lsum))

    def t_combine(self, l, s, a1, n, pbase):
        p = self.plan
        g, d = p.g, p.d
        kvh, part = divmod(a1, p.combine_parts)                              # this task's query heads h0 .. h1 - 1
        h0, h1 = part * g // p.combine_parts, (part + 1) * g // p.combine_parts
        lse = self.rd("part_lse", (slice(pbase, pbase + n),))[:, h0:h1]     # [n, heads]
        o = self.rd("part_o", (slice(pbase, pbase + n),))[:, h0:h1]         # [n, heads, d]
        M = lse.max(dim=0).values
        w = torch.exp(lse - M[None])                                        # [n, heads]
        out = (w[:, :, None] * o).sum(0) / w.sum(0)[:, None]
        self.wr("attn", (l, s, slice((kvh * g + h0) * d, (kvh * g + h1) * d)), out.reshape(-1).to(self.act))

    def t_oproj(self, l, r0, nr, *_):
        lw = self.w.layers[l]
        a = self.rd("attn", (l, slice(0, self.B)))
        bias = lw.o_bias[r0:r0 + nr] if lw.o_bias is not None else None
        self.wr("ao", (l, slice(0, self.B), slice(r0, r0 + nr)), F.linear(a, lw.o[r0:r0 + nr], bias))

    def t_router(self, l, r0, nr, *_):
        m = self.plan.moe_idx[l]
        x = self._x_in(l)
        lg = F.linear(x, self.w.layers[l].moe.router[r0:r0 + nr])
        self.wr("rlog", (m, slice(0, self.B), slice(r0, r0 + nr)), lg.float())

    def t_topk(self, l, m, *_):
        self.wr("route", (m,), self._route(m))

    def _route(self, m):
        """Layer m's route record from its router logits (TOPK's, or with worker_topk every worker's own)."""
        p, cfg = self.plan, self.plan.cfg
        B, k = self.B, p.topk
        lg = self.rd("rlog", (m, slice(0, B))).to(self.act)                 # exact: values are act-dtype
        vals, ids = torch.sort(lg, dim=-1, descending=True, stable=True)
        vals, ids = vals[:, :k], ids[:, :k]
        if cfg.expert_selection_fn == "softmax":
            sc = F.softmax(vals, dim=1, dtype=torch.float).to(self.act)
        else:
            sc = torch.sigmoid(vals)
            if cfg.norm_topk_prob:
                sc = sc / sc.sum(dim=-1, keepdim=True)
        route = torch.full((p.r_stride,), -777, dtype=torch.int32)
        active = sorted(set(ids.flatten().tolist()))
        cnt = {e: 0 for e in active}
        for s in range(B):
            for e in ids[s].tolist():
                cnt[e] += 1
        start, acc, n_slots = {}, 0, 0
        R = p.slot_pairs or B                    # slot_pairs: an expert's pairs in slots of at most R
        for e in active:
            for s0 in range(0, cnt[e], R):
                route[p.r_slot_expert + n_slots] = e
                route[p.r_slot_start + n_slots] = acc + s0
                route[p.r_slot_cnt + n_slots] = min(R, cnt[e] - s0)
                n_slots += 1
            start[e] = acc
            acc += cnt[e]
        fill = {e: 0 for e in active}
        wbits = route[p.r_pair_w:p.r_pair_w + p.n_pairs].view(torch.float32)
        for s in range(B):
            sorted_e = sorted(ids[s].tolist())
            for kk in range(k):
                e = int(ids[s, kk])
                pi = start[e] + fill[e]
                fill[e] += 1
                route[p.r_pair_row + pi] = s
                route[p.r_pair_rank + pi] = sorted_e.index(e)
                wbits[pi] = float(sc[s, kk])
                route[p.r_topk_ids + s * k + kk] = e
        assert n_slots <= p.n_slots, (n_slots, p.n_slots)
        route[0] = n_slots
        route[1] = n_slots * (p.gu_tiles + p.dn_tiles) + p.o_items
        return route


    def _claim(self, m: int) -> int:
        item = int(self.moe_work[m])
        self.moe_work[m] += 1
        return item

    def t_worker(self, l, m, *_):
        return self._worker(l, m, self.early_claim.pop(self.cur, None))

    def _worker(self, l, m, first: int | None = None):
        """first: the item this worker claimed before its wait (worker_claim_early), else None."""
        p = self.plan
        lw = self.w.layers[l].moe
        if p.worker_topk:                        # this worker routes the layer itself; the claimer of item 0 (the
            route = self._route(m)               # next claim, as the kernel's) writes the record for the host
            if int(self.moe_work[m]) == 0:
                self.wr("route", (m,), route)
        else:
            route = self.rd("route", (m,))
        n_active, n_items = int(route[0]), int(route[1])
        n_gu = n_active * p.gu_tiles
        n_o = p.o_items
        o0 = _o_start(p, n_gu)
        I = p.I
        held: list[int] = [] if first is None else [first]   # claimed, not yet run, in claim (= queue) order
        while True:
            while len(held) < self.claims_held:
                held.append(self._claim(m))
            item = held.pop(0)
            if item >= n_items:
                return
            if o0 <= item < o0 + n_o:               # an O-projection tile: waits for the layer's combines
                yield (l * p.cpl + p.c_comb, self.B * p.nkv * p.combine_parts)
                self.cur_op = "MOE_WORKER(o-proj)"
                r0 = (item - o0) * p.o_rows
                self.t_oproj(l, r0, min(p.o_rows, p.H - r0))
                continue
            # (queue_dn_lag is 0 where O items are queued: the expert items around them in lag-0 order)
            down, slot, t = queue_kind(n_active, p.gu_tiles, p.dn_tiles, p.queue_dn_lag,
                                       item - (n_o if item >= o0 + n_o else 0))
            if down:
                yield (l * p.cpl + p.c_gu + slot, p.gu_tiles)
                self.cur_op = "MOE_WORKER(down)"
            e = int(route[p.r_slot_expert + slot])
            st, cnt = int(route[p.r_slot_start + slot]), int(route[p.r_slot_cnt + slot])
            pairs = slice(st, st + cnt)
            rows = route[p.r_pair_row + st:p.r_pair_row + st + cnt].long()
            if not down:
                r0 = t * p.gu_rows
                r1 = min(I, r0 + p.gu_rows)
                x = torch.stack([self.rd("x", (l, int(r))) for r in rows])
                gate = F.linear(x, lw.experts_gate_up[e, r0:r1])
                up = F.linear(x, lw.experts_gate_up[e, I + r0:I + r1])
                self.wr("eact", (m, pairs, slice(r0, r1)), F.silu(gate) * up)
                self._wake(l * p.cpl + p.c_gu + slot)
            else:
                r0 = t * p.dn_rows
                r1 = min(p.H, r0 + p.dn_rows)
                a = self.rd("eact", (m, pairs, slice(0, I)))
                yv = F.linear(a, lw.experts_down[e, r0:r1])
                w = route[p.r_pair_w + st:p.r_pair_w + st + cnt].view(torch.float32).to(self.act)
                yv = yv * w[:, None]
                ranks = route[p.r_pair_rank + st:p.r_pair_rank + st + cnt].tolist()
                for i, (r, k) in enumerate(zip(rows.tolist(), ranks)):
                    self.wr("y", (m, r, k, slice(r0, r1)), yv[i])

    def _mlp_w(self, l):
        lw = self.w.layers[l]
        return lw.dense if lw.dense is not None else lw.moe.shared

    def t_mlp_gu(self, l, r0, nr, *_):
        w = self._mlp_w(l)
        width = self.plan.mlp_width[l]
        x = self._x_in(l)
        gate = F.linear(x, w.gate_up[r0:r0 + nr])
        up = F.linear(x, w.gate_up[width + r0:width + r0 + nr])
        self.wr("mact", (l, slice(0, self.B), slice(r0, r0 + nr)), F.silu(gate) * up)

    def t_mlp_down(self, l, r0, nr, *_):
        w = self._mlp_w(l)
        width = self.plan.mlp_width[l]
        a = self.rd("mact", (l, slice(0, self.B), slice(0, width)))
        self.wr("mout", (l, slice(0, self.B), slice(r0, r0 + nr)), F.linear(a, w.down[r0:r0 + nr]))

    def t_lm(self, l, r0, nr, t, *_):
        xf = self.rd("x", (self.plan.L, slice(0, self.B)))
        lg = (F.linear(xf, self.w.lm_head[r0:r0 + nr]) * self.plan.cfg.logit_scale).float()
        self.wr("logits", (slice(0, self.B), slice(r0, r0 + nr)), lg)
        v, i = lg.max(dim=1)                 # first maximal index on ties
        self.wr("lm_best", (t, slice(0, self.B)), torch.stack([v, (i + r0).float()], dim=1))

    def t_argmax(self, l, n, *_):
        best = self.rd("lm_best", (slice(0, n), slice(0, self.B)))          # [n, B, 2]
        v = best[:, :, 0]
        t = v.max(dim=0).indices                                            # first tile with the max
        tok = best[t, torch.arange(self.B), 1].to(torch.int32)
        self.wr("tokens", (slice(0, self.B),), tok)
