"""A pure-Python model of the paged MoE worker's synchronisation (csrc/mk_moe_pages.cuh), run under random schedules.

The kernel's roles become generators that yield whenever the CUDA code would wait; a random scheduler steps any role
whose wait is satisfied, and fires the bulk copies' landings at random later times. mbarriers are modelled with
their phase semantics (a parity wait succeeds once the phase of that parity has completed, and cannot tell phase u
from u - 2). The model checks what the CUDA code relies on: a warp computes a page only after that page's own copy
landed, with its item's input row in the slot; a copy never lands in a page a warp is reading, an input row is never
overwritten while a warp reads it; every page is computed once and every item's epilogue runs once, after all its
pages; down items run only after their gate/up items; and every schedule terminates (no deadlock), with fewer pages
than computing warps included. The end-marker deadlock found on the GPU (markers that never freed their pages) is
reproduced by the model with that step removed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest


class Deadlock(Exception):
    pass


class Mbar:
    """An mbarrier of one expected arrival per phase (the worker's are all count 1)."""

    def __init__(self) -> None:
        self.completed = 0        # phases completed
        self.pending_tx = False   # armed with a transaction count not yet landed

    def done(self, parity: int) -> bool:
        return self.completed % 2 != parity

    def complete(self) -> None:
        self.completed += 1


@dataclass
class Item:
    kind: str                     # "gu", "dn", "o"
    pages: int
    deps: tuple[int, ...] = ()    # this worker's gate/up items a down item waits for (through its expert's counter)


@dataclass
class World:
    items: list[Item]
    npg: int
    nwc: int
    slots: int = 3
    marker_frees: bool = True     # False: the pre-fix protocol (an end marker's warp did not free its page)
    claim_late: bool = False      # pg_claim_late: the loader goes on to the next item once this one's input is in
    full: list[Mbar] = field(default_factory=list)
    empty: list[Mbar] = field(default_factory=list)
    free: list[Mbar] = field(default_factory=list)
    page: list[tuple[int, int, int]] = field(default_factory=list)   # (item slot, page index, sequence)
    data: list[int] = field(default_factory=list)                     # sequence whose copy landed in the page
    reading: list[int] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)                # sequences whose copies have not landed
    seq: list[int] = field(default_factory=list)
    item_of: list[int] = field(default_factory=list)
    inp: list[int] = field(default_factory=list)
    in_readers: list[int] = field(default_factory=list)
    done: list[int] = field(default_factory=list)
    n_items: int = -1
    stop: bool = False                                                # an aborted step: every wait gives up
    issued: int = 0                                                   # sequence numbers the loader used
    computed: dict[int, int] = field(default_factory=dict)            # (item) -> pages computed
    finished: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.full = [Mbar() for _ in range(self.npg)]
        self.empty = [Mbar() for _ in range(self.npg)]
        self.free = [Mbar() for _ in range(self.slots)]
        self.page = [(-2, -1, -1)] * self.npg
        self.data = [-1] * self.npg
        self.reading = [0] * self.npg
        self.seq = [-1] * self.slots
        self.item_of = [-1] * self.slots
        self.inp = [-1] * self.slots
        self.in_readers = [0] * self.slots
        self.done = [0] * self.slots


def until(w: World, cond):
    """A role's wait (pg_wait / pg_spin_until): yield until cond() holds; False if the step stopped first, when the
    role returns (`if not (yield from until(...)): return`)."""
    while not cond():
        if w.stop:
            return False
        yield
    return True


def _ring_page(w: World, s: int):
    """The loader's wait for sequence s's ring page: its previous lap's page freed."""
    slot = s % w.npg
    return (yield from until(w, lambda: s < w.npg or w.empty[slot].done((s // w.npg - 1) & 1)))


def loader(w: World):
    s = 0
    for j, it in enumerate(w.items):
        q = j % w.slots
        if not (yield from until(w, lambda: j < w.slots or w.free[q].done((j // w.slots - 1) & 1))):
            return
        w.item_of[q] = j
        w.seq[q] = j                                   # (after the description: the input warp)
        for p in range(it.pages):
            slot = s % w.npg
            if not (yield from _ring_page(w, s)):
                return
            assert w.reading[slot] == 0, "the loader reuses a page a warp is reading"
            w.page[slot] = (q, p, s)
            w.full[slot].pending_tx = True
            w.in_flight.append(s)
            s += 1
            w.issued = s
            yield
        if not (yield from until(w, lambda: not w.claim_late or w.inp[q] == j)):
            return
    w.n_items = len(w.items)
    for _ in range(w.nwc):
        slot = s % w.npg
        if not (yield from _ring_page(w, s)):
            return
        w.page[slot] = (-1, 0, s)
        w.full[slot].complete()                        # an end marker: a plain arrive
        s += 1
        w.issued = s
        yield


def input_warp(w: World):
    j = 0
    while True:
        q = j % w.slots
        while w.seq[q] != j:
            if (w.n_items >= 0 and j >= w.n_items) or w.stop:
                return
            yield
        it = w.items[w.item_of[q]]
        if not (yield from until(w, lambda: all(d in w.finished for d in it.deps))):   # its gate/up counter
            return
        assert w.in_readers[q] == 0, "an input row overwritten while a warp reads it"
        w.inp[q] = j
        yield
        j += 1


def computing_warp(w: World, warp: int):
    s = warp
    while True:
        slot = s % w.npg
        par = (s // w.npg) & 1
        if not (yield from until(w, lambda: w.page[slot][2] == s and w.full[slot].done(par))):
            return
        q, p, _ = w.page[slot]
        if q < 0:
            if w.marker_frees:
                w.empty[slot].complete()
            return
        j = w.item_of[q]
        if not (yield from until(w, lambda: w.inp[q] == j)):
            return
        assert w.data[slot] == s, f"page {s} read before its copy landed (holds {w.data[slot]})"
        w.reading[slot] += 1
        w.in_readers[q] += 1
        yield                                          # the page's math
        w.reading[slot] -= 1
        w.in_readers[q] -= 1
        w.computed[j] = w.computed.get(j, 0) + 1
        w.empty[slot].complete()
        w.done[q] += 1
        if w.done[q] == w.items[j].pages:
            assert w.computed[j] == w.items[j].pages and j not in w.finished
            for d in w.items[j].deps:
                assert d in w.finished, "a down item ran before its gate/up item"
            w.finished.add(j)
            w.done[q] = 0
            w.free[q].complete()
        s += w.nwc


def run(w: World, rng: random.Random, max_steps: int = 200_000, stop_at: int | None = None) -> None:
    """Random schedules until every role returned; stop_at: the step at which the step is aborted (then every role
    must still return, and every copy issued still lands before the worker's memory is released)."""
    roles = [loader(w), input_warp(w)] + [computing_warp(w, k) for k in range(w.nwc)]
    alive = list(range(len(roles)))
    stalled = 0
    for step in range(max_steps):
        if step == stop_at:
            w.stop = True
        if not alive:
            break
        # a copy lands at a random later time
        if w.in_flight and rng.random() < 0.3:
            s = w.in_flight.pop(rng.randrange(len(w.in_flight)) if rng.random() < 0.2 else 0)
            slot = s % w.npg
            assert w.reading[slot] == 0, "a copy lands in a page a warp is reading"
            w.data[slot] = s
            w.full[slot].pending_tx = False
            w.full[slot].complete()
            stalled = 0
            continue
        k = rng.choice(alive)
        before = _snapshot(w)
        try:
            next(roles[k])
        except StopIteration:
            alive.remove(k)
            stalled = 0
            continue
        stalled = 0 if _snapshot(w) != before else stalled + 1
        if stalled > 50 * len(roles) and not w.in_flight:
            raise Deadlock(f"roles {alive} all wait (pages={w.npg}, warps={w.nwc})")
    else:
        raise Deadlock("step limit")
    if w.stop:
        # the drain (thread 0) waits for the last pg_n sequence numbers' copies: every copy still in flight is one
        assert all(s >= w.issued - w.npg for s in w.in_flight)
        return
    assert w.finished == set(range(len(w.items)))
    assert all(w.computed[j] == it.pages for j, it in enumerate(w.items))


def _snapshot(w: World) -> tuple:
    return (tuple(m.completed for m in w.full), tuple(m.completed for m in w.empty),
            tuple(m.completed for m in w.free), tuple(w.page), tuple(w.seq), tuple(w.inp), w.n_items,
            tuple(w.done), tuple(w.reading), len(w.finished), sum(w.computed.values()))


def random_items(rng: random.Random, n: int) -> list[Item]:
    """A worker's items in claim order: gate/up items (12 pages at North dims: 2 x 24 rows of 2048), then down items
    (7 pages: 64 rows of 768) interleaved with O items (12 pages: 24 rows of 4096); a down item waits for a random
    subset of this worker's gate/up items."""
    n_gu = rng.randint(0, n)
    items = [Item("gu", rng.choice([1, 3, 12])) for _ in range(n_gu)]
    for _ in range(n - n_gu):
        if rng.random() < 0.25:
            items.append(Item("o", rng.choice([1, 12])))
        else:
            deps = tuple(d for d in range(n_gu) if rng.random() < 0.3)
            items.append(Item("dn", rng.choice([1, 7]), deps))
    return items


@pytest.mark.parametrize("npg,nwc", [(12, 14), (6, 14), (4, 14), (7, 14), (14, 14), (16, 14), (12, 15), (5, 3)])
def test_paged_worker_protocol_terminates_and_keeps_its_invariants(npg, nwc):
    """The kernel's 14 computing warps (and 15, 3) on rings of 4..16 pages, 0..12 items of every kind."""
    rng = random.Random(npg * 100 + nwc)
    for trial in range(60):
        items = random_items(rng, rng.randint(0, 12))
        run(World(items, npg, nwc), random.Random(trial))


@pytest.mark.parametrize("npg", [4, 12, 16])
def test_paged_worker_protocol_with_the_late_claim(npg):
    """pg_claim_late: the loader waits for each item's input (its dependency) before it goes on: still no deadlock."""
    rng = random.Random(7 + npg)
    for trial in range(60):
        items = random_items(rng, rng.randint(0, 12))
        run(World(items, npg, 14, claim_late=True), random.Random(trial))


@pytest.mark.parametrize("npg", [4, 12])
def test_paged_worker_protocol_leaves_on_an_abort(npg):
    """An aborted step (a counter wait failed) at a random point: every role still returns, whatever it waited on."""
    rng = random.Random(npg)
    for trial in range(60):
        items = random_items(rng, rng.randint(1, 10))
        w = World(items, npg, 14)
        run(w, random.Random(trial), stop_at=rng.randint(0, 400))


def test_the_model_finds_the_end_marker_deadlock():
    """With the end markers not freeing their pages, fewer pages than computing warps deadlock (what the GPU hit at
    North dims: 12 pages, 15 warps), and enough pages do not: the model can fail."""
    items = [Item("gu", 12), Item("dn", 7, (0,))]
    with pytest.raises(Deadlock):
        run(World(items, 12, 15, marker_frees=False), random.Random(1))
    run(World(items, 16, 15, marker_frees=False), random.Random(1))
