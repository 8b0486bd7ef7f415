"""The megakernel's SM timeline: what every block did during one decode step, from the profiling build's stamps.

The profiling build (`build.load(profile=True)`, `MegakernelBackend.profile_next_step()`) writes one record per
task and per MoE work item (layout in opcodes.PROF_FIELDS) and a clock calibration per block. This module turns
them into a `Timeline` on one nanosecond time base, checks its invariants, summarises where the step's time went
(per opcode: busy, dependency wait, weight landing, bytes and GB/s; the critical path through the dependency graph;
the start-up ramp and the idle tail), and renders a Chrome/Perfetto trace and a PNG.

`emulate()` builds the same records from a simple model of the kernel (blocks claim tickets in list order, each
task lasts a fixed cost plus its bytes at a per-SM rate): the CPU tests check the summary and the pictures on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megakernel.kernel import opcodes as O

F = {n: i for i, n in enumerate(O.PROF_FIELDS)}
PB = {n: i for i, n in enumerate(O.PROF_BLOCK_FIELDS)}
STAMPS = O.PROF_STAMPS


def op_name(op: int) -> str:
    if op == O.PROF_ITEM_GU:
        return "MOE_GATE_UP"
    if op == O.PROF_ITEM_DN:
        return "MOE_DOWN"
    if op == O.PROF_ITEM_O:
        return "OPROJ_ITEM"
    try:
        return O.Op(op).name
    except ValueError:
        return f"op{op}"


@dataclass
class RawProfile:
    """What the profiling build wrote for one launch, and what the host knew when it launched it."""

    tasks: np.ndarray              # [n_tasks, PROF_INTS] int64 stamps (%globaltimer ns; older records: clock64);
                                   # row i = ticket i
    items: np.ndarray              # [n, PROF_INTS] int64, the MoE work items that ran
    blocks: np.ndarray             # [grid, PROF_BLOCK_INTS] int64
    records: np.ndarray            # the task list [n_tasks, REC_INTS] int32
    task_bytes: np.ndarray         # bytes each task reads from HBM (weights, K/V)
    item_bytes: dict[int, int]     # pseudo-op -> bytes of one MoE work item
    counter_names: dict[int, str] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


@dataclass
class Timeline:
    """Stamps in ns from the step's launch (the first block's start). Columns: see `Events`."""

    tasks: "Events"
    items: "Events"
    n_blocks: int
    timer_step_ns: float           # resolution of the GPU's global timer: cross-SM comparisons hold to about it
    block_start: np.ndarray        # [grid] ns
    records: np.ndarray
    counter_names: dict[int, str]
    meta: dict

    @property
    def step_ns(self) -> float:
        return float(max(self.tasks.end.max(initial=0), self.items.end.max(initial=0)))


@dataclass
class Events:
    block: np.ndarray
    sm: np.ndarray
    op: np.ndarray
    layer: np.ndarray
    arg: np.ndarray
    claim: np.ndarray
    issued: np.ndarray
    waited: np.ndarray
    landed: np.ndarray
    computed: np.ndarray
    end: np.ndarray
    nbytes: np.ndarray
    marks: np.ndarray | None = None     # [n, len(PROF_MARK_FIELDS)] ns, NaN where a mark was not taken

    def __len__(self) -> int:
        return len(self.op)


def to_timeline(raw: RawProfile) -> Timeline:
    """Map every block's stamps to ns through its (globaltimer, stamp) pairs at start and end (the identity for
    %globaltimer stamps; older records stamped clock64)."""
    b = raw.blocks.astype(np.float64)
    g0, c0, g1, c1 = (b[:, PB[k]] for k in ("g_start", "c_start", "g_end", "c_end"))
    rate = (g1 - g0) / np.maximum(c1 - c0, 1.0)              # ns per clock, per block
    origin = g0.min()

    n_marks = len(O.PROF_MARK_FIELDS)

    def events(rows: np.ndarray, nbytes: np.ndarray) -> Events:
        if rows.shape[1] == O.PROF_INTS - n_marks - 1:   # records from before the `computed` stamp: computed = end
            rows = np.insert(rows, F["computed"], rows[:, F["computed"]], axis=1)
        if rows.shape[1] == O.PROF_INTS - n_marks:       # records from before the marks: none taken
            rows = np.concatenate([rows, np.full((len(rows), n_marks), -1, rows.dtype)], axis=1)
        blk = rows[:, F["block"]].astype(np.int64)
        to_ns = lambda c: g0[blk] + (c - c0[blk]) * rate[blk] - origin   # noqa: E731
        cols = {k: to_ns(rows[:, F[k]].astype(np.float64)) for k in STAMPS}
        raw_marks = rows[:, [F[k] for k in O.PROF_MARK_FIELDS]].astype(np.float64)
        marks = np.where(raw_marks >= 0, to_ns(raw_marks.T).T if len(rows) else raw_marks, np.nan)
        return Events(blk, rows[:, F["sm"]].astype(np.int64), rows[:, F["op"]].astype(np.int64),
                      rows[:, F["layer"]].astype(np.int64), rows[:, F["arg"]].astype(np.int64), **cols,
                      nbytes=nbytes.astype(np.float64), marks=marks)

    item_b = np.array([raw.item_bytes.get(int(op), 0) for op in raw.items[:, F["op"]]], dtype=np.float64)
    return Timeline(events(raw.tasks, raw.task_bytes), events(raw.items, item_b), len(raw.blocks),
                    float(raw.blocks[:, PB["timer_step_ns"]].max(initial=0)), g0 - origin, raw.records,
                    raw.counter_names, dict(raw.meta))


# ---- invariants ----------------------------------------------------------------------------------------------
def producers(records: np.ndarray) -> dict[int, np.ndarray]:
    """counter -> the task indices that signal it."""
    sig = records[:, O.R["sig"]]
    out: dict[int, list[int]] = {}
    for i, c in enumerate(sig.tolist()):
        if c >= 0:
            out.setdefault(c, []).append(i)
    return {c: np.asarray(v) for c, v in out.items()}


def check_invariants(raw: RawProfile, tl: Timeline, tol_ns: float | None = None) -> list[str]:
    """What must hold for any correct trace: every task recorded exactly once under its own ticket and opcode, the
    stamps of each task and item in order, and no task's wait over before every producer of its counters ended
    (to within the timer's resolution across SMs). Returns the violations (empty: all good)."""
    tol = tl.timer_step_ns * 2 + 100 if tol_ns is None else tol_ns
    bad: list[str] = []
    rec, t = raw.records, tl.tasks
    n = len(rec)
    if len(t) != n:
        bad.append(f"{len(t)} task records for {n} tasks")
        return bad
    tickets = raw.tasks[:, F["arg"]]
    if not np.array_equal(tickets, np.arange(n)):
        missing = np.setdiff1d(np.arange(n), tickets)
        bad.append(f"tasks without their record: {missing[:10].tolist()} ({len(missing)} in all)")
    if not np.array_equal(raw.tasks[:, F["op"]], rec[:, O.R["op"]]):
        bad.append("task records whose opcode differs from the task list's")
    for name, ev in (("task", t), ("item", tl.items)):
        start = ev.claim
        order = [(start <= ev.issued), (start <= ev.waited), (np.maximum(ev.issued, ev.waited) <= ev.landed),
                 (ev.landed <= ev.computed), (ev.computed <= ev.end)]
        ok = np.logical_and.reduce(order) if len(ev) else np.ones(0, bool)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            bad.append(f"{(~ok).sum()} {name}s with stamps out of order, e.g. #{i}: "
                       + ", ".join(f"{k} {getattr(ev, k)[i]:.0f}" for k in STAMPS))
    prod = producers(rec)
    late = 0
    example = ""
    for k in range(O.MAX_WAITS):
        cs = rec[:, O.R[f"w{k}c"]]
        for i in np.flatnonzero(cs >= 0):
            p = prod.get(int(cs[i]))
            if p is None:
                continue
            worst = t.end[p].max()
            if t.waited[i] + tol < worst:
                late += 1
                if not example:
                    example = (f"task {i} ({op_name(int(rec[i, 0]))}) ended its wait at {t.waited[i]:.0f} ns, "
                               f"a producer of counter {int(cs[i])} ended at {worst:.0f} ns")
    if late:
        bad.append(f"{late} waits over before their producers ended: {example}")
    return bad


# ---- summary --------------------------------------------------------------------------------------------------
def critical_path(tl: Timeline) -> list[int]:
    """Task indices of the dependency chain that ends the step: from the last task to end, repeatedly the producer
    (of any counter the task waited on) that ended last."""
    rec, t = tl.records, tl.tasks
    prod = producers(rec)
    cur = int(np.argmax(t.end))
    path = [cur]
    while True:
        best, best_end = -1, -np.inf
        for k in range(O.MAX_WAITS):
            c = int(rec[cur, O.R[f"w{k}c"]])
            if c >= 0 and c in prod:
                p = prod[c]
                j = int(p[np.argmax(t.end[p])])
                if t.end[j] > best_end:
                    best, best_end = j, t.end[j]
        if best < 0:
            break
        path.append(best)
        cur = best
    return path[::-1]


def _marked_kinds(tl: Timeline) -> Iterator[tuple[str, Events, np.ndarray, tuple[str, ...]]]:
    """(name, events, mask, mark labels) of every task kind that took marks (opcodes.PROF_MARKS) in this step."""
    for ev in (tl.tasks, tl.items):
        if not len(ev) or ev.marks is None:
            continue
        for op in np.unique(ev.op):
            name = op_name(int(op))
            labels = O.PROF_MARKS.get(name)
            m = ev.op == op
            if labels and np.isfinite(ev.marks[m]).any():
                yield name, ev, m, labels


def phases(tl: Timeline) -> dict[str, dict[str, float]]:
    """For each task kind that takes marks (opcodes.PROF_MARKS): the mean time in us after its claim of every stamp
    and every mark it took, in time order, so the phases of its work read off as differences."""
    out: dict[str, dict[str, float]] = {}
    for name, ev, m, labels in _marked_kinds(tl):
        at = {k: float((getattr(ev, k)[m] - ev.claim[m]).mean()) / 1e3 for k in STAMPS if k != "claim"}
        for j, label in enumerate(labels):
            v = ev.marks[m, j] - ev.claim[m]
            if np.isfinite(v).any():
                at[label] = float(np.nanmean(v)) / 1e3
        out[name] = {k: round(v, 3) for k, v in sorted(at.items(), key=lambda kv: kv[1])}
    return out


def phase_spans(tl: Timeline) -> dict[str, dict[str, list[float]]]:
    """For each task kind that takes marks: the [median, p90] in us of each phase (from one stamp or mark to the
    next, in the mean order of `phases`), over the tasks or items that took both ends. Means hide the bimodal
    phases (an item whose inputs were already in shared memory next to one that loads them); medians do not."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, ev, m, labels in _marked_kinds(tl):
        cols = {k: getattr(ev, k)[m].astype(float) for k in STAMPS}
        for j, label in enumerate(labels):
            cols[label] = ev.marks[m, j].astype(float)
        order = sorted(cols, key=lambda k: np.nanmean(cols[k]) if np.isfinite(cols[k]).any() else np.inf)
        order = [k for k in order if np.isfinite(cols[k]).any()]
        spans = {}
        for a, b in zip(order, order[1:]):
            d = (cols[b] - cols[a]) / 1e3
            d = d[np.isfinite(d)]
            if len(d):
                spans[b] = [round(float(np.median(d)), 3), round(float(np.percentile(d, 90)), 3)]
        out[name] = spans
    return out


def critical_chain(tl: Timeline) -> list[tuple[str, int]]:
    """The chain of events that ends the step, tasks ("t", index) and MoE items ("i", index), first to last. From the
    event that ends last, step back to whichever ended later: its data dependency (the producers of a task's
    counters; a down item's gate/up items of the same expert; a gate/up item's top-k) or its SM's previous event
    (the task before it on its block, the item before it in its worker). A worker task steps into its last item.
    Unlike `critical_path` (data edges only), a task that waited for a block, not for its inputs, points at what held
    the block, so the routed experts show up as themselves."""
    t, it, rec = tl.tasks, tl.items, tl.records
    prod = producers(rec)
    by_block = {b: np.flatnonzero(t.block == b)[np.argsort(t.claim[t.block == b])] for b in np.unique(t.block)}
    pos = {int(i): k for b, idx in by_block.items() for k, i in enumerate(idx)}
    iorder = np.lexsort((it.claim, it.block)) if len(it) else np.zeros(0, np.int64)
    iblock, iclaim = it.block[iorder], it.claim[iorder]
    ipos = np.empty_like(iorder)
    ipos[iorder] = np.arange(len(iorder))         # item -> its place in iorder
    topk = {int(rec[i, O.R["layer"]]): int(i) for i in np.flatnonzero(rec[:, O.R["op"]] == O.Op.TOPK)}
    gu = it.op == O.PROF_ITEM_GU

    def end(n: tuple[str, int]) -> float:
        return float(t.end[n[1]] if n[0] == "t" else it.end[n[1]])

    def worker_items(w: int) -> np.ndarray:
        b = t.block[w]
        lo, hi = np.searchsorted(iblock, b, "left"), np.searchsorted(iblock, b, "right")
        sel = iorder[lo:hi][(iclaim[lo:hi] >= t.claim[w]) & (iclaim[lo:hi] <= t.end[w])]
        return sel

    def later(a: tuple[str, int] | None, b: tuple[str, int] | None) -> tuple[str, int] | None:
        if a is None or b is None:
            return a or b
        return a if end(a) >= end(b) else b

    def back(n: tuple[str, int]) -> tuple[str, int] | None:
        kind, i = n
        if kind == "t":
            if t.op[i] == O.Op.MOE_WORKER:
                items = worker_items(i)
                if len(items):
                    return ("i", int(items[-1]))
            data = None
            for k in range(O.MAX_WAITS):
                c = int(rec[i, O.R[f"w{k}c"]])
                if c >= 0 and c in prod:
                    p = prod[c]
                    data = later(data, ("t", int(p[np.argmax(t.end[p])])))
            k = pos[i]
            res = ("t", int(by_block[t.block[i]][k - 1])) if k else None
            return later(data, res)
        layer = int(it.layer[i])
        if it.op[i] == O.PROF_ITEM_DN:
            same = np.flatnonzero(gu & (it.layer == layer) & ((it.arg >> 16) == (it.arg[i] >> 16)))
            data = ("i", int(same[np.argmax(it.end[same])])) if len(same) else None
        else:
            data = ("t", topk[layer]) if layer in topk else None
        k = int(ipos[i])
        res = None
        if k and iblock[k - 1] == it.block[i]:
            prev = int(iorder[k - 1])
            if it.end[prev] <= it.claim[i] + 1:
                res = ("i", prev)
        return later(data, res)

    last_t = ("t", int(np.argmax(t.end)))
    node = last_t
    if len(it) and it.end.max() > t.end.max():
        node = ("i", int(np.argmax(it.end)))
    chain = [node]
    seen = {node}
    while True:
        p = back(node)
        if p is None or p in seen or end(p) > end(node) + 1:
            break
        chain.append(p)
        seen.add(p)
        node = p
    return chain[::-1]


def layer_events(tl: Timeline) -> dict[str, dict[str, float]]:
    """A typical layer's timeline: for every task kind (and MoE item kind) of layer l, when its first task was
    claimed and stopped waiting, and when its first and last ended, in us after the layer's start, as medians over
    the layers that have one. A layer starts where its NORM task ends ("next NORM": layer l + 1's), or, where its
    tiles normalise their own rows (`fused_norm`: no NORM task), where the first of its QKV / router tiles stops
    waiting, i.e. when the previous layer's outputs are complete ("next layer's inputs": layer l + 1's). Where a
    step mixes the two (layer 0 and the final norm keep their NORM tasks; `fused_qkv=0` keeps them all while its
    router tiles start before them, at negative times) the medians mix the two anchors and each "next" row covers
    only the layers followed by its kind."""
    t = tl.tasks
    base: dict[int, float] = {}
    norm_at: dict[int, int] = {}
    for i in np.flatnonzero(t.op == O.Op.NORM):
        base[int(t.layer[i])] = float(t.end[i])
        norm_at[int(t.layer[i])] = int(i)
    fused = (t.op == O.Op.QKV) | (t.op == O.Op.ROUTER)
    for l in np.unique(t.layer[fused]).tolist():
        if l not in base:
            base[int(l)] = float(t.waited[fused & (t.layer == l)].min())
    rows: dict[str, list[tuple[float, float, float, float]]] = {}
    for l, b in sorted(base.items()):
        for ev in (t, tl.items):
            m = ev.layer == l
            for op in np.unique(ev.op[m]):
                mm = m & (ev.op == op)
                rows.setdefault(op_name(int(op)), []).append(
                    (ev.claim[mm].min() - b, ev.waited[mm].min() - b, ev.end[mm].min() - b, ev.end[mm].max() - b))
        if l + 1 in norm_at:
            i = norm_at[l + 1]
            e = t.end[i] - b
            rows.setdefault("next NORM", []).append((t.claim[i] - b, t.waited[i] - b, e, e))
        elif l + 1 in base:
            e = base[l + 1] - b
            rows.setdefault("next layer's inputs", []).append((e, e, e, e))
    rows.pop("NORM", None)
    out = {}
    for name, v in rows.items():
        med = np.median(np.asarray(v, dtype=np.float64), axis=0) / 1e3
        out[name] = {k: round(float(x), 2) for k, x in zip(("first_claim", "first_waited", "first_end", "last_end"),
                                                           med)}
    return dict(sorted(out.items(), key=lambda kv: kv[1]["last_end"]))


def moe_worker_tails(tl: Timeline) -> dict:
    """How the MoE workers end (us): per worker task, how long it outlived its own last item (the plain worker's
    failed claim and signal; the paged worker's drain and end markers as well), how many items it ran, and per layer
    how long after the layer's last item its last worker ended. Large values mean work queued behind few workers
    (claimed ahead) or a slow exit, not HBM time. {} without item records."""
    t, it = tl.tasks, tl.items
    w = np.flatnonzero(t.op == O.Op.MOE_WORKER)
    if not len(w) or not len(it):
        return {}
    n_layers = int(max(t.layer.max(), it.layer.max())) + 1
    key = lambda blk, lay: blk * n_layers + lay                         # noqa: E731
    size = (int(max(t.block.max(), it.block.max())) + 1) * n_layers
    last = np.full(size, -np.inf)
    count = np.zeros(size, dtype=np.int64)
    np.maximum.at(last, key(it.block, it.layer), it.end)
    np.add.at(count, key(it.block, it.layer), 1)
    kw = key(t.block[w], t.layer[w])
    ran = np.isfinite(last[kw])
    tails = (t.end[w] - last[kw])[ran] / 1e3
    per_layer = []
    for lay in np.unique(t.layer[w]).tolist():
        mi = it.layer == lay
        if mi.any():
            per_layer.append((t.end[w][t.layer[w] == lay].max() - it.end[mi].max()) / 1e3)
    stat = lambda v: dict(median=round(float(np.median(v)), 2), p90=round(float(np.percentile(v, 90)), 2),  # noqa: E731
                          max=round(float(np.max(v)), 2)) if len(v) else {}
    return dict(tail_after_own_last_item_us=stat(tails),
                items_per_worker=dict(mean=round(float(count[kw].mean()), 2), max=int(count[kw].max())),
                idle_workers=int((~ran).sum()),
                last_worker_after_layer_items_us=stat(np.asarray(per_layer)))


def summarize(tl: Timeline) -> dict:
    """Where the step's time went. Time figures in microseconds; "SM-us" are summed over blocks, so dividing by
    the block count gives the share of the step's wall time."""
    t, items = tl.tasks, tl.items
    step = tl.step_ns
    per_op: dict[str, dict] = {}

    def add(ev: Events, mask: np.ndarray, name: str) -> None:
        if not mask.any():
            return
        d = per_op.setdefault(name, dict(count=0, busy=0.0, dep_wait=0.0, load_wait=0.0, compute=0.0, epilogue=0.0,
                                         bytes=0.0))
        d["count"] += int(mask.sum())
        d["busy"] += float((ev.end - ev.claim)[mask].sum()) / 1e3
        d["dep_wait"] += float((ev.waited - ev.claim)[mask].sum()) / 1e3
        d["load_wait"] += float((ev.landed - np.maximum(ev.waited, ev.claim))[mask].sum()) / 1e3
        d["compute"] += float((ev.end - ev.landed)[mask].sum()) / 1e3
        d["epilogue"] += float((ev.end - ev.computed)[mask].sum()) / 1e3     # of compute: after the GEMV core
        d["bytes"] += float(ev.nbytes[mask].sum())

    for op in np.unique(t.op):
        add(t, t.op == op, op_name(int(op)))
    for op in np.unique(items.op):
        add(items, items.op == op, op_name(int(op)))
    for d in per_op.values():
        d["gb_per_s_per_sm"] = d["bytes"] / (d["busy"] * 1e3) if d["busy"] > 0 else 0.0
        d["gb_per_s_of_step"] = d["bytes"] / step if step > 0 else 0.0
    # per block: start-up, gaps between tasks, idle tail
    first = np.full(tl.n_blocks, np.inf)
    last = np.zeros(tl.n_blocks)
    busy_per_block = np.zeros(tl.n_blocks)
    np.minimum.at(first, t.block, t.claim)
    np.maximum.at(last, t.block, t.end)
    np.add.at(busy_per_block, t.block, t.end - t.claim)
    first = np.where(np.isfinite(first), first, step)
    tail = step - last
    head = first
    gaps = np.maximum(0.0, (last - first) - busy_per_block)
    chain = critical_chain(tl)
    path_ops: dict[str, float] = {}
    prev_end = 0.0
    for kind, i in chain:
        ev = t if kind == "t" else items
        name = op_name(int(ev.op[i]))
        path_ops[name] = path_ops.get(name, 0.0) + (ev.end[i] - max(prev_end, 0.0)) / 1e3
        prev_end = ev.end[i]
    chain_end = prev_end
    sm_us = {
        "dependency waits": float((t.waited - t.claim).sum()) / 1e3,
        "weights landing": float((t.landed - np.maximum(t.waited, t.claim)).sum()) / 1e3,
        "compute (GEMV core, attention, norms, routing)": float((t.computed - t.landed).sum()) / 1e3,
        "epilogues and signals (after a GEMV core)": float((t.end - t.computed).sum()) / 1e3,
        "start-up (before the first task)": float(head.sum()) / 1e3,
        "idle tail (after the last task)": float(tail.sum()) / 1e3,
        "between tasks (claim, record fetch)": float(gaps.sum()) / 1e3,
    }
    return dict(
        phases=phases(tl),
        phase_spans=phase_spans(tl),
        layer_events=layer_events(tl),
        moe_workers=moe_worker_tails(tl),
        step_us=step / 1e3, n_blocks=tl.n_blocks, n_tasks=len(t), n_items=len(items),
        timer_step_ns=tl.timer_step_ns, per_op=per_op,
        last_block_start_us=float(head.max()) / 1e3,
        idle_tail_us=dict(mean=float(tail.mean()) / 1e3, max=float(tail.max()) / 1e3),
        critical_path=dict(us=float(chain_end) / 1e3, tasks=len(chain),   # tasks and MoE items on it
                           by_op={k: round(float(v), 2) for k, v in sorted(path_ops.items(), key=lambda kv: -kv[1])}),
        sm_time_us_per_step={k: round(v / tl.n_blocks, 2) for k, v in sorted(sm_us.items(), key=lambda kv: -kv[1])},
        meta=tl.meta,
    )


def format_summary(s: dict) -> str:
    lines = [f"megakernel step: {s['step_us']:.1f} us on {s['n_blocks']} blocks, {s['n_tasks']} tasks + "
             f"{s['n_items']} MoE items (global timer step {s['timer_step_ns']:.0f} ns)"]
    lines.append(f"{'opcode':<14}{'count':>8}{'busy SM-us':>12}{'dep wait':>10}{'landing':>10}{'compute':>10}"
                 f"{'epilogue':>10}{'MB':>9}{'GB/s/SM':>9}{'GB/s':>7}")
    for name, d in sorted(s["per_op"].items(), key=lambda kv: -kv[1]["busy"]):
        lines.append(f"{name:<14}{d['count']:>8}{d['busy']:>12.0f}{d['dep_wait']:>10.0f}{d['load_wait']:>10.0f}"
                     f"{d['compute']:>10.0f}{d.get('epilogue', 0.0):>10.0f}{d['bytes'] / 1e6:>9.1f}"
                     f"{d['gb_per_s_per_sm']:>9.1f}"
                     f"{d['gb_per_s_of_step']:>7.0f}")
    cp = s["critical_path"]
    lines.append(f"critical path: {cp['us']:.1f} us through {cp['tasks']} tasks and items; by opcode (us): "
                 + ", ".join(f"{k} {v:.1f}" for k, v in cp["by_op"].items()))
    lines.append(f"last block starts {s['last_block_start_us']:.1f} us after launch; idle tail mean "
                 f"{s['idle_tail_us']['mean']:.1f} us, max {s['idle_tail_us']['max']:.1f} us")
    lines.append("SM time per step (us, summed over blocks / blocks): "
                 + ", ".join(f"{k} {v:.1f}" for k, v in s["sm_time_us_per_step"].items()))
    for name, at in s.get("phases", {}).items():
        lines.append(f"phases of {name} (mean us after its claim): " + ", ".join(f"{k} {v:.2f}" for k, v in at.items()))
    if s.get("layer_events"):
        lines.append("a layer (medians, us after its start; first claim / first wait end / first end / last end): "
                     + ", ".join(f"{k} " + "/".join(f"{x:.1f}" for x in v.values())
                                 for k, v in s["layer_events"].items()))
    mw = s.get("moe_workers")
    if mw:
        ta, la = mw["tail_after_own_last_item_us"], mw["last_worker_after_layer_items_us"]
        lines.append(f"MoE workers: a worker ends {ta['median']:.2f} us after its own last item (p90 {ta['p90']:.2f}, "
                     f"max {ta['max']:.2f}); {mw['items_per_worker']['mean']:.1f} items per worker (max "
                     f"{mw['items_per_worker']['max']}), {mw['idle_workers']} workers without one; a layer's last "
                     f"worker ends {la.get('median', 0.0):.2f} us after its last item (median over layers, max "
                     f"{la.get('max', 0.0):.2f})")
    for name, sp in s.get("phase_spans", {}).items():
        lines.append(f"phase lengths of {name} (median / p90 us, each phase ending at): "
                     + ", ".join(f"{k} {v[0]:.2f}/{v[1]:.2f}" for k, v in sp.items()))
    return "\n".join(lines)


# ---- renderings -----------------------------------------------------------------------------------------------
def chrome_trace(tl: Timeline) -> dict:
    """Chrome / Perfetto trace: one track per block (one block per SM), one slice per task with its waits as
    nested slices, MoE work items nested in their worker task."""
    ev = []
    for b in range(tl.n_blocks):
        sms = tl.tasks.sm[tl.tasks.block == b]
        label = f"SM {int(sms[0])} (block {b})" if len(sms) else f"block {b}"
        ev.append(dict(ph="M", name="thread_name", pid=0, tid=b, args=dict(name=label)))
        ev.append(dict(ph="M", name="thread_sort_index", pid=0, tid=b, args=dict(sort_index=b)))

    def slices(e: Events, i: int, name: str, args: dict) -> None:
        b = int(e.block[i])
        us = lambda x: round(float(x) / 1e3, 3)  # noqa: E731
        ev.append(dict(ph="X", pid=0, tid=b, name=name, ts=us(e.claim[i]), dur=us(e.end[i] - e.claim[i]),
                       args=args))
        if e.waited[i] > e.claim[i]:
            ev.append(dict(ph="X", pid=0, tid=b, name="wait: dependency", ts=us(e.claim[i]),
                           dur=us(e.waited[i] - e.claim[i]), cname="grey"))
        lo = max(e.waited[i], e.claim[i])
        if e.landed[i] > lo:
            ev.append(dict(ph="X", pid=0, tid=b, name="wait: weights landing", ts=us(lo), dur=us(e.landed[i] - lo),
                           cname="yellow"))
        if e.end[i] > e.computed[i] > e.landed[i]:
            ev.append(dict(ph="X", pid=0, tid=b, name="epilogue + signal", ts=us(e.computed[i]),
                           dur=us(e.end[i] - e.computed[i]), cname="olive"))

    t = tl.tasks
    for i in range(len(t)):
        slices(t, i, op_name(int(t.op[i])), dict(layer=int(t.layer[i]), ticket=int(t.arg[i]),
                                                 bytes=int(t.nbytes[i])))
    it = tl.items
    for i in range(len(it)):
        slices(it, i, op_name(int(it.op[i])), dict(layer=int(it.layer[i]), expert=int(it.arg[i]) >> 16,
                                                   item=int(it.arg[i]) & 0xFFFF, bytes=int(it.nbytes[i])))
    return dict(traceEvents=ev, displayTimeUnit="ns", otherData=dict(tl.meta))


def write_trace(tl: Timeline, path: str) -> None:
    """The Chrome trace as JSON (gzip-compressed when `path` ends in .gz; Perfetto opens both)."""
    text = json.dumps(chrome_trace(tl), separators=(",", ":"))
    if path.endswith(".gz"):
        import gzip

        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)


COLORS = {"NORM": "#7f7f7f", "QKV": "#1f77b4", "ATTN": "#ff7f0e", "ATTN_COMBINE": "#ffbb78", "OPROJ": "#2ca02c",
          "ROUTER": "#9467bd", "TOPK": "#c5b0d5", "MOE_WORKER": "#e0e0e0", "MOE_GATE_UP": "#d62728",
          "MOE_DOWN": "#ff9896", "MLP_GU": "#8c564b", "MLP_DOWN": "#c49c94", "LM_HEAD": "#17becf",
          "ARGMAX": "#000000"}


def plot_timeline(tl: Timeline, path: str, title: str | None = None,
                  window_us: tuple[float, float] | None = None) -> None:
    """One row per block (y), time (x), colour by opcode; dependency waits hatched, weight landing pale. Drawn as
    one collection of rectangles per (opcode, part), so a step's ~10^5 tasks render in seconds. `window_us`
    zooms into part of the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(16, max(4.0, tl.n_blocks * 0.07)))
    used: set[str] = set()
    use_items = len(tl.items) > 0

    def boxes(y: np.ndarray, x0: np.ndarray, x1: np.ndarray) -> np.ndarray:
        keep = x1 > x0
        y, x0, x1 = y[keep], x0[keep], x1[keep]
        return np.stack([np.stack([x0, y - 0.4], 1), np.stack([x1, y - 0.4], 1), np.stack([x1, y + 0.4], 1),
                         np.stack([x0, y + 0.4], 1)], 1)

    for e in (tl.tasks, tl.items):
        names = np.array([op_name(int(o)) for o in e.op])
        for name in np.unique(names):
            if use_items and name == "MOE_WORKER":
                continue            # drawn through its items
            m = names == name
            used.add(str(name))
            c = COLORS.get(str(name), "#bcbd22")
            y = e.block[m].astype(np.float64)
            t0, tw, tld, t1 = (getattr(e, k)[m] / 1e3 for k in ("claim", "waited", "landed", "end"))
            lo = np.maximum(tw, t0)
            ax.add_collection(PolyCollection(boxes(y, t0, tw), facecolors=c, alpha=0.25, hatch="////",
                                             edgecolors=c, linewidths=0))
            ax.add_collection(PolyCollection(boxes(y, lo, tld), facecolors=c, alpha=0.45, linewidths=0))
            ax.add_collection(PolyCollection(boxes(y, tld, t1), facecolors=c, linewidths=0))
    ax.set_xlabel("time since launch (us)")
    ax.set_ylabel("block (one per SM)")
    ax.set_ylim(-1, tl.n_blocks)
    ax.set_xlim(*(window_us or (0, tl.step_ns / 1e3)))
    ax.invert_yaxis()
    handles = [Patch(color=COLORS.get(n, "#bcbd22"), label=n) for n in sorted(used)]
    handles += [Patch(facecolor="white", edgecolor="grey", hatch="////", label="dependency wait"),
                Patch(facecolor="grey", alpha=0.45, label="weights landing")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title or f"megakernel decode step: {tl.step_ns / 1e3:.0f} us")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_raw(raw: RawProfile, path: str) -> None:
    """The launch's records as a compressed .npz (the trace, PNG and summary can be rebuilt from it)."""
    as_json = lambda d: json.dumps({str(k): v for k, v in d.items()})  # noqa: E731
    np.savez_compressed(path, tasks=raw.tasks, items=raw.items, blocks=raw.blocks, records=raw.records,
                        task_bytes=raw.task_bytes, item_bytes=as_json(raw.item_bytes),
                        counter_names=as_json(raw.counter_names), meta=json.dumps(raw.meta, default=str))


def load_raw(path: str) -> RawProfile:
    z = np.load(path)
    return RawProfile(z["tasks"], z["items"], z["blocks"], z["records"], z["task_bytes"],
                      {int(k): v for k, v in json.loads(str(z["item_bytes"])).items()},
                      {int(k): v for k, v in json.loads(str(z["counter_names"])).items()}, json.loads(str(z["meta"])))


def percentiles(a: np.ndarray, digits: int = 2) -> list[float]:
    """[p10, p50, p90] of a, rounded (the trace tools' figures); [] for no samples."""
    return [round(float(v), digits) for v in np.percentile(a, [10, 50, 90])] if len(a) else []


def router_wait(tl: Timeline, layer: int) -> float:
    """When layer's first router tile stopped waiting (ns): the origin of a layer in the bandwidth and SM-state tools
    (benchmarks/layer_bandwidth.py, sm_states.py), so their bins line up."""
    m = (tl.tasks.op == O.Op.ROUTER) & (tl.tasks.layer == layer)
    if not m.any():
        raise ValueError(f"layer {layer} has no router tiles (a dense layer, or past the last): pick a MoE layer")
    return float(np.nanmin(tl.tasks.waited[m]))


def bin_overlap(a: np.ndarray, b: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """[n, bins] ns of each span [a, b) inside each bin between consecutive edges."""
    lo = np.maximum(a[:, None], edges[None, :-1])
    hi = np.minimum(b[:, None], edges[None, 1:])
    return np.clip(hi - lo, 0, None)


def trace_tool_parser(doc: str) -> argparse.ArgumentParser:
    """The command line benchmarks/'s trace tools share: a trace (.npz), --layer (default 20) and --json OUT; a tool
    adds its own options."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("npz")
    ap.add_argument("--layer", type=int, default=20)
    ap.add_argument("--json", default=None)
    return ap


def write_tool_json(res: dict, args, script_file: str) -> None:
    """A trace tool's --json, if given: `res` with the trace's provenance and the tool's own command line."""
    if args.json:
        cmd = "python " + " ".join([f"benchmarks/{Path(script_file).name}", *sys.argv[1:]])
        write_derived_json(res, args.json, args.npz, cmd)


def write_derived_json(res: dict, out_path: str, npz_path: str, script: str) -> None:
    """Write `res`, a figure derived from the trace at npz_path, as JSON that names what it came from: the trace's
    commit, date, GPU, bench command and build switches (from the summary bench wrote beside it, when there is one)
    and the script that derived it."""
    summary = Path(npz_path[:-4] + ".summary.json") if npz_path.endswith(".npz") else None
    rec: dict = {}
    if summary is not None and summary.exists():
        run = json.loads(summary.read_text())
        rec = {k: run[k] for k in ("commit", "date", "gpu") if k in run}
        rec["trace_command"] = run.get("command")
        if run.get("env"):
            rec["trace_env"] = run["env"]
    rec["derived_by"] = script
    Path(out_path).write_text(json.dumps({**rec, **res}, indent=1) + "\n")


# ---- bytes each task moves --------------------------------------------------------------------------------------
def task_bytes(plan, si, records: np.ndarray) -> tuple[np.ndarray, dict[int, int]]:
    """HBM bytes each task reads (weight tiles, K/V of its split), and of one MoE work item by kind."""
    op, layer, a1 = records[:, O.R["op"]], records[:, O.R["layer"]], records[:, O.R["a1"]].astype(np.int64)
    H, Q, d, elt = plan.H, plan.Q, plan.d, 2
    out = np.zeros(len(records), dtype=np.int64)
    for o, k in ((O.Op.QKV, H), (O.Op.ROUTER, H), (O.Op.LM_HEAD, H), (O.Op.OPROJ, Q)):
        m = op == o
        out[m] = a1[m] * k * elt
    m = op == O.Op.MLP_GU
    out[m] = 2 * a1[m] * H * elt
    for i in np.flatnonzero(op == O.Op.MLP_DOWN):
        out[i] = a1[i] * plan.mlp_width[int(layer[i])] * elt
    Bm = plan.max_batch
    pos = si.step[Bm:Bm + si.B]
    info = plan.layer_info()
    S = si.split_tokens
    for i in np.flatnonzero(op == O.Op.ATTN):
        s, j, l = int(records[i, O.R["a0"]]), int(records[i, O.R["a2"]]), int(layer[i])
        p = int(pos[s])
        W = int(info[l, O.LAYER_INFO_FIELDS.index("window")])
        lo = max(0, p - W + 1) if W > 0 else 0
        k0 = lo + j * S
        out[i] = max(0, min(p + 1, k0 + S) - k0) * d * 2 * elt
    items = {O.PROF_ITEM_GU: 2 * plan.gu_rows * H * elt, O.PROF_ITEM_DN: plan.dn_rows * plan.I * elt,
             O.PROF_ITEM_O: plan.o_rows * Q * elt}
    return out, items


# ---- a model of the schedule (CPU tests) ---------------------------------------------------------------------------
def emulate(records: np.ndarray, nbytes: np.ndarray, n_blocks: int, *, task_ns: float = 3600.0,
            gbps_per_sm: float = 30.0, clock_ghz: float = 1.98, seed: int = 0) -> RawProfile:
    """Records as the profiling build would write them for a kernel where blocks claim tickets in list order and
    each task takes `task_ns` plus its bytes at `gbps_per_sm`, its loads issued at claim and its wait over once
    every producer ended. MoE workers run no items here."""
    rng = np.random.default_rng(seed)
    n = len(records)
    prod = producers(records)
    free = np.zeros(n_blocks)
    end = np.zeros(n)
    rows = np.zeros((n, O.PROF_INTS), dtype=np.int64)
    start_g = rng.uniform(0, 2000, n_blocks)                 # blocks start at slightly different times
    free[:] = start_g
    clock0 = rng.integers(1 << 30, 1 << 40, n_blocks).astype(np.float64)

    def clk(b: int, ns: float) -> int:
        return int(clock0[b] + (ns - start_g[b]) * clock_ghz)

    for i in range(n):
        b = int(np.argmin(free))
        claim = free[b]
        ready = claim
        for k in range(O.MAX_WAITS):
            c = int(records[i, O.R[f"w{k}c"]])
            if c >= 0 and c in prod:
                ready = max(ready, end[prod[c]].max())
        load_ns = nbytes[i] / gbps_per_sm
        issued = claim + 50.0
        landed = max(ready, issued + load_ns)
        end[i] = landed + task_ns * rng.uniform(0.8, 1.2)
        computed = landed + 0.75 * (end[i] - landed)
        free[b] = end[i] + 200.0
        rows[i] = [b, b, int(records[i, O.R["op"]]), int(records[i, O.R["layer"]]), i,
                   clk(b, claim), clk(b, issued), clk(b, ready), clk(b, landed), clk(b, computed), clk(b, end[i]),
                   *([-1] * len(O.PROF_MARK_FIELDS))]
        if O.Op(int(records[i, O.R["op"]])).name in O.PROF_MARKS:     # a mark halfway through the work
            rows[i, F["m0"]] = clk(b, (ready + end[i]) / 2)
    blocks = np.zeros((n_blocks, O.PROF_BLOCK_INTS), dtype=np.int64)
    step_end = free.max()
    for b in range(n_blocks):
        blocks[b] = [int(start_g[b]), clk(b, start_g[b]), int(step_end), clk(b, step_end), 32, b]
    return RawProfile(rows, np.zeros((0, O.PROF_INTS), np.int64), blocks, records, nbytes, {},
                      meta=dict(emulated=True))


if __name__ == "__main__":   # python -m megakernel.kernel.timeline RAW.npz OUT.png [from_us to_us]: redraw a saved step
    raw_ = load_raw(sys.argv[1])
    tl_ = to_timeline(raw_)
    win = (float(sys.argv[3]), float(sys.argv[4])) if len(sys.argv) > 4 else None
    plot_timeline(tl_, sys.argv[2], window_us=win,
                  title=f"megakernel decode step ({tl_.step_ns / 1e3:.0f} us)" + (f", {win[0]:.0f}-{win[1]:.0f} us"
                                                                                if win else ""))
    print(format_summary(summarize(tl_)))
