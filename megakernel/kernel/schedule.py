"""Host side of the decode megakernel: the task list of one decode step, and its inputs (the static plan it is
built from, tiles, layouts, scratch and counters, is plan.py's ModelPlan).

A decode step is a list of small tasks (see opcodes.Op) in a topological order: every task only waits on
counters whose producer tasks all come *earlier* in the list. The kernel hands tasks out with one global ticket
(atomicAdd) in list order, so the following argument shows it cannot deadlock (it holds for the CPU simulator,
which runs the same list in random dependency-respecting orders, too):

  Let T be the smallest ticket not yet finished. T has been claimed (tickets are claimed in increasing order by
  running blocks, and a block only claims a new ticket after it finished all of its earlier ones but at most the
  one it is executing), so some resident block is executing T. Every counter T waits on is produced only by
  tasks with smaller tickets, all finished, so T's waits are satisfied and T finishes. By induction every ticket
  finishes. No assumption on co-residency of blocks is needed: a block that never started claimed nothing.

  Routed experts are data dependent. Each MoE layer gets `n_workers` MOE_WORKER tasks (after the layer's TOPK in
  the list) that wait for the routing (knob `worker_topk`: for the router tiles, static tasks listed before them;
  each worker then computes the same routing from the same logits itself), then claim work items from the
  layer's queue with a second atomic counter: first every gate/up tile of every active expert, then every down
  tile, with (knob `o_queue`) the layer's O-projection tiles placed after the first `o_after` eighths of the down
  tiles. A down item waits for the gate/up items of its expert, which have smaller item numbers
  and were therefore claimed earlier by workers that execute them without waiting on anything else; an O item
  waits for the layer's attention combines, static tasks with smaller tickets than every worker, so the ticket
  induction finishes them; so the same induction applies to items. A worker runs its items in claim order and
  signals the layer's MLP counter once, after it found the queue empty; the counter reaches n_workers only when
  every claimed item is finished.

  Knob `workers_early`: that many of a MoE layer's workers are listed before its attention splits instead of after
  its combines, so they stream experts while the other blocks run attention. Only in plans whose O projection is
  static tasks (no O items in the queue, which wait on the combines): an early worker waits on the routing (listed
  before it) and its items on gate/up items of workers, so the induction is unchanged.

  Knob `router_topk`: no TOPK task; each router tile adds to its layer's router counter with an acq_rel atomic, and
  the one that completes the count routes the layer and then signals the top-k counter the workers wait on. That
  tile waits on nothing more (every other tile released its logits before its add), so it finishes like any static
  task, and the top-k counter's producer is a router tile, listed before every worker of its layer: the induction
  holds with the router tiles as the counter's producers (`validate()` counts them so).

`validate()` checks the precondition (every wait refers only to earlier producers and its target equals the
number of producers) on every list built in tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from megakernel.kernel import opcodes as O
from megakernel.kernel.plan import ModelPlan, lm_runs, split_fits_table

Op = O.Op


@dataclass
class StepInputs:
    """Per-step inputs in the kernel's format."""

    B: int
    split_tokens: int
    nsplit: np.ndarray            # [B, G] splits per (sequence, group)
    step: np.ndarray              # int32: ids[Bm], pos[Bm], toff[Bm*G], tbase[Bm*G]
    tables: np.ndarray            # int32 flat block tables (only the blocks a query can see)
    positions: list[int] = field(default_factory=list)

    @property
    def signature(self) -> tuple:
        """What the step's task list depends on (its cache key): the rows and their splits. Not the split size,
        which only the launch's parameters carry, so `short_splits`' changing sizes reuse the same lists."""
        return (self.B, self.nsplit.tobytes())


def step_inputs(plan: ModelPlan, input_ids: list[int], positions: list[int],
                block_tables: list[list[list[int]]]) -> StepInputs:
    """Pack one decode step (one new token per sequence) for the kernel; checks the block tables."""
    B = len(input_ids)
    if not 1 <= B <= plan.max_batch:
        raise ValueError(f"decode batch of {B} rows; this megakernel serves 1..{plan.max_batch}")
    G, bs, Bm = plan.n_groups, plan.layout.block_size, plan.max_batch
    los = np.zeros((B, G), dtype=np.int64)
    for gi, grp in enumerate(plan.groups):
        for s, p in enumerate(positions):
            los[s, gi] = 0 if grp.window is None else max(0, p - grp.window + 1)
    pos = np.asarray(positions, dtype=np.int64)
    ranges = pos[:, None] + 1 - los
    S = plan.split_size(int(ranges.max()), B, ranges.max(axis=1).tolist())
    nsplit = ((ranges + S - 1) // S).astype(np.int32)
    if not split_fits_table(S, bs):
        raise ValueError(f"attention splits of {S} keys over {bs}-token KV blocks span up to {S // bs + 2} blocks; "
                         f"the kernel holds {O.ATTN_TABLE_SLOTS} (use larger KV blocks or a smaller split_tokens)")
    step = np.zeros(2 * Bm + 2 * Bm * G, dtype=np.int32)
    step[:B] = input_ids
    step[Bm:Bm + B] = positions
    flat: list[int] = []
    for s in range(B):
        p = positions[s]
        for gi in range(G):
            base = int(los[s, gi]) // bs
            last = p // bs
            table = block_tables[s][gi]
            if len(table) <= last:
                raise ValueError(f"sequence {s}: block table of group {plan.groups[gi].name} does not cover "
                                 f"position {p}")
            part = table[base:last + 1]
            if min(part) < 0:
                raise ValueError(f"sequence {s}: a visible KV block of group {plan.groups[gi].name} was recycled")
            step[2 * Bm + s * G + gi] = len(flat)
            step[2 * Bm + Bm * G + s * G + gi] = base
            flat.extend(part)
    return StepInputs(B=B, split_tokens=S, nsplit=nsplit, step=step,
                      tables=np.asarray(flat if flat else [0], dtype=np.int32), positions=list(positions))


# ---------------------------------------------------------------------------------------------------------------
# Task list
# ---------------------------------------------------------------------------------------------------------------


def _records(op: int, layer, n: int = 1, sig=-1, waits=(), **args) -> np.ndarray:
    """n task records of one kind (fields broadcast from scalars or length-n arrays)."""
    rec = np.full((n, O.REC_INTS), -1, dtype=np.int32)
    rec[:, O.R["op"]] = int(op)
    rec[:, O.R["layer"]] = layer
    for k in ("a0", "a1", "a2", "a3"):
        rec[:, O.R[k]] = args.get(k, 0)
    rec[:, O.R["sig"]] = sig
    for i, (c, t) in enumerate(waits):
        rec[:, O.R[f"w{i}c"]] = c
        rec[:, O.R[f"w{i}t"]] = t
    rec[:, O.R["flags"]:] = 0
    rec[:, O.R["flags"]] = args.get("flags", 0)
    return rec


@dataclass
class _AttnSlot:
    """Where a layer's attention splits and combines go in a task-list template: all they depend on but nsplit."""
    l: int
    gi: int                        # the layer's KV group (nsplit's column)
    qkv_c: np.ndarray              # the layer's per-kv-head QKV counters, and their targets
    qkv_t: np.ndarray
    c_comb: int                    # the combines' counter


class _Emitter:
    def __init__(self) -> None:
        self.parts: list[np.ndarray | _AttnSlot] = []

    def emit(self, op: int, layer, n: int = 1, sig=-1, waits=(), **args) -> None:
        self.parts.append(_records(op, layer, n, sig, waits, **args))


@dataclass
class TaskList:
    records: np.ndarray           # [n_tasks, REC_INTS] int32
    n_partials: int
    targets: dict[int, int]       # counter -> expected final value (for diagnostics)
    names: dict[int, str]         # counter -> description


def _tiles(n_rows: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    r0 = np.arange(0, n_rows, rows, dtype=np.int32)
    return r0, np.minimum(rows, n_rows - r0).astype(np.int32)


def qkv_tiles(Q: int, KV: int, d: int, g: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A layer's QKV tiles (first row, rows) in row order: each kv head's Q rows (g heads of d), then each kv head's
    K rows, then its V rows, cut into the fewest tiles of at most `rows` rows, near-equal and even (multiples of 8
    where `rows` is), so no tile spans two kv heads (a tile signals its kv head's counter) and each holds whole RoPE
    pairs. Where `rows` divides d these are the uniform tiles of `rows`."""
    if rows < 2 or rows % 2:
        raise ValueError(f"QKV tiles hold whole RoPE pairs: want an even row count >= 2, got {rows}")
    q = 8 if rows % 8 == 0 and d % 8 == 0 else 2
    starts, counts = [], []
    segments = [(h * g * d, g * d) for h in range(Q // (g * d))] + [(Q + h * d, d) for h in range(2 * KV // d)]
    for s0, n in segments:
        k = -(-n // rows)
        units, extra = divmod(n // q, k)
        sizes = [q * (units + 1)] * extra + [q * units] * (k - extra)
        starts.extend(s0 + np.cumsum([0] + sizes[:-1]))
        counts.extend(sizes)
    return np.asarray(starts, np.int32), np.asarray(counts, np.int32)


def build_tasks(plan: ModelPlan, B: int, nsplit: np.ndarray) -> TaskList:
    """The task list of one decode step of B rows with `nsplit[s, group]` attention splits."""
    return TaskListBuilder(plan, B).build(nsplit)


class TaskListBuilder:
    """The task lists of B-row steps of one plan. Only the attention splits and their combines depend on the step's
    split counts: the rest of the list (most of its Python-level work) is built once here, and build() fills in
    each layer's splits and combines, vectorised. A list is rebuilt whenever a row crosses a split boundary; on the
    2-core CI machine a rebuild took 8.6 ms at 1 x 8K and 12.6 at 16 x 8K, now 2.6 and 4.0 (16 x 256K: ~19 -> ~16,
    its 245K attention records themselves)."""

    def __init__(self, plan: ModelPlan, B: int) -> None:
        self.plan, self.B = plan, B
        self.parts, self.targets, self.names = _template(plan, B)

    def build(self, nsplit: np.ndarray) -> TaskList:
        plan, B = self.plan, self.B
        nkv, cp = plan.nkv, plan.combine_parts
        targets = dict(self.targets)
        out: list[np.ndarray] = []
        part = 0
        s_pair, h_pair = np.repeat(np.arange(B), nkv), np.tile(np.arange(nkv), B)
        for seg in self.parts:
            if not isinstance(seg, _AttnSlot):
                out.append(seg)
                continue
            l = seg.l
            # attention splits: per (sequence, kv head) pair in sequence-major order, nsplit[s] splits each
            n_pair = np.repeat(nsplit[:B, seg.gi].astype(np.int64), nkv)
            first = part + np.concatenate([[0], np.cumsum(n_pair)[:-1]]).astype(np.int64)   # first partial slot
            c_pair = l * plan.cpl + plan.c_att + s_pair * nkv + h_pair
            targets.update(zip(c_pair.tolist(), n_pair.tolist()))
            comb = np.repeat(np.stack([s_pair, h_pair, n_pair, first, c_pair], axis=1), cp, axis=0)
            comb[:, 1] = comb[:, 1] * cp + np.tile(np.arange(cp), len(s_pair))    # a1 = kv head * parts + part
            s_a, h_a, p_a = np.repeat(s_pair, n_pair), np.repeat(h_pair, n_pair), np.repeat(first, n_pair)
            j_a = np.arange(int(n_pair.sum())) - (p_a - part)
            part += int(n_pair.sum())
            att_sig = l * plan.cpl + plan.c_att + s_a * nkv + h_a
            out.append(_records(Op.ATTN, l, len(s_a), sig=att_sig, waits=[(seg.qkv_c[h_a], seg.qkv_t[h_a])],
                                a0=s_a, a1=h_a, a2=j_a, a3=p_a))
            # the combines, ahead of the MoE workers: a worker keeps its block until the layer's queue is empty, so
            # a combine listed after them is claimed only once the experts are done
            out.append(_records(Op.ATTN_COMBINE, l, len(comb), sig=seg.c_comb, waits=[(comb[:, 4], comb[:, 2])],
                                a0=comb[:, 0], a1=comb[:, 1], a2=comb[:, 2], a3=comb[:, 3]))
        records = np.concatenate(out) if out else np.zeros((0, O.REC_INTS), np.int32)
        return TaskList(records=records, n_partials=part, targets=targets, names=self.names)


def _template(plan: ModelPlan, B: int) -> tuple[list, dict[int, int], dict[int, str]]:
    """The task list of B-row steps with an _AttnSlot where each layer's attention splits and combines go, the
    counters' targets (all but the attention splits' own) and every counter's name."""
    em = _Emitter()
    L, H, Q, KV, d, g, nkv = plan.L, plan.H, plan.Q, plan.KV, plan.d, plan.g, plan.nkv
    cpl = plan.cpl
    targets: dict[int, int] = {}
    names: dict[int, str] = {}

    def ctr(l: int, off: int, name: str, target: int) -> int:
        c = l * cpl + off
        targets[c] = target
        names[c] = f"layer {l} {name}"
        return c

    n_o_tiles = plan.n_o_tiles
    prev_done: list[tuple[int, int]] = []
    for l in range(L):
        gi, _ = plan.layout.locate(l)
        moe = l in plan.moe_idx
        kind = plan.mlp_kind[l]
        # 1. residual + norm per row (or, fused, inside each tile that reads the normed rows; with fused_qkv=0 only
        #    the router tiles fuse, and a NORM task per row writes x and h for the QKV tiles and the MoE items)
        fuse = 1 <= l and B <= plan.fused_norm
        fuse_qkv = fuse and bool(plan.fused_qkv)
        if fuse_qkv:
            x_waits, fl = prev_done, O.FLAG_FUSED_NORM
            norm_waits: list[tuple[int, int]] = []
        else:
            c_x = ctr(l, plan.c_x, "norm (rows)", B)
            em.emit(Op.NORM, l, B, sig=c_x, waits=prev_done, a0=np.arange(B))
            x_waits, fl = [(c_x, B)], 0
            norm_waits = [(c_x, B)] if fuse else []      # the MoE items read the NORM's x, not a router tile's
        r_waits, r_fl = (prev_done, O.FLAG_FUSED_NORM) if fuse else (x_waits, fl)
        # 2. router tiles and the top-k, ahead of the QKV tiles by default (`router_first`): router -> top-k ->
        #    experts is the longer of a layer's two branches; listed after the QKV tiles (160 then), the router tiles
        #    and the top-k were claimed in the blocks' second wave, ~8 us after the norm
        m = plan.moe_idx.get(l, -1)

        def emit_routing() -> int:
            r0, nr = _tiles(plan.E, plan.router_rows)
            c_rl = ctr(l, plan.c_rl, "router tiles", len(r0))
            # router_topk: a2 the top-k counter, a3 the tile count; the tile whose signal completes the count
            # routes the layer and signals a2 (no TOPK task, no hop between the last logits and the routing)
            c_rt = ctr(l, plan.c_route, "top-k", 1) if plan.router_topk else 0
            # fused: the tile of row 0 writes the normed rows the MoE items read (they wait on all router tiles)
            em.emit(Op.ROUTER, l, len(r0), sig=c_rl, waits=r_waits, a0=r0, a1=nr, a2=c_rt,
                    a3=len(r0) if plan.router_topk else 0,
                    flags=r_fl | np.where(fuse_qkv & (r0 == 0), O.FLAG_WRITE_X, 0))
            for j in range(plan.n_slots):
                # targets of the per-slot gate/up counters are dynamic (gu_tiles when the slot is active)
                names[l * cpl + plan.c_gu + j] = f"layer {l} expert slot {j} gate/up items"
            if plan.worker_topk:             # the workers route the layer themselves, from the router tiles
                return c_rl, len(r0)
            if plan.router_topk:
                return c_rt, 1
            c = ctr(l, plan.c_route, "top-k", 1)
            em.emit(Op.TOPK, l, 1, sig=c, waits=[(c_rl, len(r0))], a0=m)
            return c, 1

        route_wait = emit_routing() if moe and plan.router_first else (-1, 0)   # what the workers wait on
        # 3. QKV tiles, grouped by the kv head whose counter they feed
        r0, nr = qkv_tiles(Q, KV, d, plan.g, plan.qkv_rows)
        head = np.where(r0 < Q, r0 // d // g, np.where(r0 < Q + KV, (r0 - Q) // d, (r0 - Q - KV) // d))
        if plan.qkv_by_head:     # a head's attention waits for all its tiles: list them together, K/V first, so
            region = np.where(r0 < Q, 2, np.where(r0 < Q + KV, 0, 1))    # the first heads' attention starts
            order = np.lexsort((r0, region, head))                        # before the last tiles are claimed
            r0, nr, head = r0[order], nr[order], head[order]
        qkv_c = [ctr(l, plan.c_qkv + h, f"qkv (kv head {h})", int((head == h).sum())) for h in range(nkv)]
        # fused: the tile of row 0 writes the residual rows the next layer's tiles (and the final norm) read
        late = O.FLAG_LATE_WEIGHTS if plan.tb <= plan.qkv_late_weights else 0
        em.emit(Op.QKV, l, len(r0), sig=np.asarray(qkv_c, np.int32)[head], waits=x_waits, a0=r0, a1=nr,
                flags=fl | late | np.where(fuse_qkv & (r0 == 0), O.FLAG_WRITE_H, 0))
        if moe and not plan.router_first:
            route_wait = emit_routing()
        # 4. static MLP gate/up tiles
        n_mgu = n_mdn = 0
        if kind != O.MLP_NONE:
            w = plan.mlp_width[l]
            r0, nr = _tiles(w, plan.mgu_rows)
            n_mgu = len(r0)
            c_mgu = ctr(l, plan.c_mgu, "mlp gate/up tiles", n_mgu)
            em.emit(Op.MLP_GU, l, n_mgu, sig=c_mgu, waits=x_waits, a0=r0, a1=nr, flags=fl)
            n_mdn = math.ceil(H / plan.mdn_rows[w])
        # 5. attention splits and 6. their combines (TaskListBuilder.build), ahead of the MoE workers
        for s_ in range(B):
            for h_ in range(nkv):
                names[l * cpl + plan.c_att + s_ * nkv + h_] = f"layer {l} attention splits (seq {s_}, kv head {h_})"
        cp = plan.combine_parts                  # a combine task per (pair, part of its query heads)
        c_comb = ctr(l, plan.c_comb, "attention combines", B * nkv * cp)
        o_in_queue = moe and plan.o_items > 0
        c_mlp = l * cpl + plan.c_mlp
        n_early = plan.n_workers_early if moe else 0

        def emit_workers(n: int) -> None:
            """n of this MoE layer's workers (the list may place them in up to three groups)."""
            if n:
                em.emit(Op.MOE_WORKER, l, n, sig=c_mlp, waits=[route_wait] + norm_waits, a0=m)

        emit_workers(n_early)                    # (workers_early: ahead of the attention splits)
        em.parts.append(_AttnSlot(l, gi, np.asarray(qkv_c, np.int32), np.asarray([targets[c] for c in qkv_c]), c_comb))

        def emit_oproj() -> int:
            """This layer's O-projection tiles. Listed after the MoE workers by default: a block that claims one
            waits for the combines, and listed first, up to 128 such blocks would hold SMs the experts need
            (`oproj_first` measures that trade)."""
            r0, nr = _tiles(H, plan.o_rows)
            c = ctr(l, plan.c_o, "o-proj tiles", n_o_tiles)
            em.emit(Op.OPROJ, l, len(r0), sig=c, waits=[(c_comb, B * nkv * cp)], a0=r0, a1=nr)
            return c

        # 7. MoE workers (but the early ones); static O tiles among them where oproj_first / o_workers_after say
        n_late = plan.n_workers - n_early if moe else 0
        o_before = n_late                        # workers listed ahead of the O tiles (n_late: O after the MLP)
        if moe and not o_in_queue:
            o_before = plan.o_workers_ahead
        c_o = -1
        mlp_target = 0
        if moe:
            emit_workers(o_before)
            if o_before < n_late:
                c_o = emit_oproj()
                emit_workers(n_late - o_before)
            mlp_target += plan.n_workers
        elif plan.oproj_first:
            c_o = emit_oproj()
        # 8. static MLP down tiles
        if kind != O.MLP_NONE:
            r0, nr = _tiles(H, plan.mdn_rows[plan.mlp_width[l]])
            em.emit(Op.MLP_DOWN, l, len(r0), sig=c_mlp, waits=[(c_mgu, n_mgu)], a0=r0, a1=nr)
            mlp_target += n_mdn
        ctr(l, plan.c_mlp, "mlp (workers + down tiles)", mlp_target)
        # 9. output projection (unless listed before the workers, or items of the expert queue: then the workers'
        #     counter covers them, since a worker signals only after its last item)
        if o_in_queue:
            prev_done = [(c_mlp, mlp_target)]
        else:
            if c_o < 0:
                c_o = emit_oproj()
            prev_done = [(c_o, n_o_tiles), (c_mlp, mlp_target)]
    # final norm, LM head, argmax
    targets[plan.c_xf] = B
    names[plan.c_xf] = "final norm (rows)"
    em.emit(Op.NORM, L, B, sig=plan.c_xf, waits=prev_done, a0=np.arange(B))
    runs = np.asarray(plan.lm_runs, dtype=np.int32)
    r0, nr = runs[:, 0], runs[:, 1]
    targets[plan.c_lm] = len(r0)
    names[plan.c_lm] = "lm-head tasks"
    # a3: rows per tile of a streaming run (0: the task is one tile)
    em.emit(Op.LM_HEAD, L, len(r0), sig=plan.c_lm, waits=[(plan.c_xf, B)], a0=r0, a1=nr,
            a2=np.arange(len(r0)), a3=plan.lm_rows if plan.lm_wbuf else 0)
    em.emit(Op.ARGMAX, L, 1, sig=-1, waits=[(plan.c_lm, len(r0))], a0=len(r0))
    return em.parts, targets, names


def validate(tl: TaskList) -> None:
    """Every wait names a counter whose producers all come earlier in the list, with target == #producers
    (dynamic per-slot expert counters excepted: those are waited on inside MOE_WORKER tasks only)."""
    rec = tl.records
    produced: dict[int, int] = {}
    final = {}
    routed_by: dict[int, int] = {}   # router_topk: top-k counter -> index of its last router tile in the list
    for i in range(len(rec)):
        c = int(rec[i, O.R["sig"]])
        if c >= 0:
            final[c] = final.get(c, 0) + 1
        if int(rec[i, O.R["op"]]) == Op.ROUTER and int(rec[i, O.R["a3"]]) > 0:
            routed_by[int(rec[i, O.R["a2"]])] = i
    for c in routed_by:
        final[c] = final.get(c, 0) + 1      # signalled once, by whichever of its router tiles completes the count
    routes_at = {i: c for c, i in routed_by.items()}   # list index of a counter's last router tile -> the counter
    for i in range(len(rec)):
        for k in range(O.MAX_WAITS):
            c, t = int(rec[i, O.R[f"w{k}c"]]), int(rec[i, O.R[f"w{k}t"]])
            if c < 0:
                continue
            if produced.get(c, 0) != final.get(c, 0):
                raise AssertionError(f"task {i} ({Op(int(rec[i, 0])).name}) waits on counter {c} "
                                     f"({tl.names.get(c)}) that a later task produces")
            if t != final.get(c, 0):
                raise AssertionError(f"task {i} waits for {t} on counter {c} ({tl.names.get(c)}) with "
                                     f"{final.get(c, 0)} producers")
        c = int(rec[i, O.R["sig"]])
        if c >= 0:
            produced[c] = produced.get(c, 0) + 1
        if i in routes_at:                  # every router tile of the counter is listed by now
            produced[routes_at[i]] = produced.get(routes_at[i], 0) + 1
