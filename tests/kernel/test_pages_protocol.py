"""A pure-Python model of the paged MoE worker's synchronisation (csrc/mk_moe_pages.cuh), run under random schedules.

The kernel's roles become generators that yield whenever the CUDA code would wait; a random scheduler steps any role
whose wait is satisfied, and fires the bulk copies' landings at random later times. mbarriers are modelled with
their phase semantics (a parity wait succeeds once the phase of that parity has completed, and cannot tell phase u
from u - 2; a phase completes when its expected arrivals have arrived and its copies landed). Every hand-off is an
mbarrier, as in the kernel: the loader publishes an item's description (`desc`), the input warp its inputs (`inp`),
each computing warp's lanes an arrival per page on the item's `outs` (the loader the rest of the count), the epilogue's warp
frees the item slot (`free`), and computing warp w owns ring page w (`full` / `empty`). The model checks what the CUDA
code relies on: a warp computes a page only after that page's own copy landed, with its item's inputs in the slot; a
copy never lands in a page a warp is reading, inputs are never overwritten while a warp reads them; every page is
computed once and every item's epilogue runs once, after all its pages; down items run only after their gate/up
items; and every schedule terminates (no deadlock), an aborted one included. With more computing warps than pages and
parity waits alone (the ambiguity the one-page-per-warp rule removes), the model finds a page read before its copy
landed.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import pytest

LANES = 32                  # a computing warp's lanes each arrive on `outs` (each releases its own output stores)
OUT_ARRIVALS = LANES * 64   # (the kernel's is 32 x PAGE_ITEM_PAGES_MAX; any count above an item's pages' models it)
END = -1


class Deadlock(Exception):
    pass


class Mbar:
    """An mbarrier: `count` arrivals per phase, and (full pages) a copy that must land too."""

    def __init__(self, count: int = 1) -> None:
        self.count = count
        self.arrived = 0
        self.completed = 0        # phases completed
        self.pending_tx = False   # armed with a transaction count not yet landed

    def done(self, parity: int) -> bool:
        return self.completed % 2 != parity

    def arrive(self, n: int = 1) -> None:
        self.arrived += n
        assert self.arrived <= self.count, "more arrivals than the phase expects"
        self._maybe_complete()

    def land(self) -> None:
        self.pending_tx = False
        self._maybe_complete()

    def _maybe_complete(self) -> None:
        if self.arrived == self.count and not self.pending_tx:
            self.arrived = 0
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
    nwc: int = 0                  # computing warps (0: npg, the kernel's rule); more: warp w takes pages w, w + nwc, ...
    slots: int = 3
    claim_late: bool = False      # pg_claim_late: the loader goes on to the next item once this one's inputs are in
    multi_issue: bool = False     # MK_PG_MULTI_ISSUE: an item's pages in rounds of <= npg, each page issued when its
                                  # own ring page frees (any order within a round)
    any_slot: bool = False        # MK_PG_ANY_SLOT: each page, in sequence order, into any ring page free then (the
                                  # kernel takes the lowest; the model any), each ring page's laps counted apart
    page_warps: int = 1           # MK_PG_PAGE_WARPS: computing warps per ring page (2: warps w and w + npg share page
                                  # w, each half its rows; `empty` counts both, each arrives on `outs` and counts)
    rng: random.Random = field(default_factory=lambda: random.Random(0))   # (the round's issue order)
    full: list[Mbar] = field(default_factory=list)
    empty: list[Mbar] = field(default_factory=list)
    desc: list[Mbar] = field(default_factory=list)
    inp: list[Mbar] = field(default_factory=list)
    outs: list[Mbar] = field(default_factory=list)
    free: list[Mbar] = field(default_factory=list)
    page: list[tuple[int, int]] = field(default_factory=list)     # (item slot or -1, page index)
    data: list[int] = field(default_factory=list)                 # sequence whose copy landed in the page
    reading: list[int] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)            # sequences whose copies have not landed
    item_of: list[int] = field(default_factory=list)              # the slot's description (END: no more items)
    inputs_of: list[int] = field(default_factory=list)            # the item whose inputs the slot holds
    in_readers: list[int] = field(default_factory=list)
    done: list[int] = field(default_factory=list)
    stop: bool = False                                            # an aborted step: every wait gives up
    issued: int = 0                                               # sequence numbers the loader used
    seq: list[int] = field(default_factory=list)                  # each page's last issued sequence (MULTI_ISSUE)
    laps: list[list[int]] = field(default_factory=list)           # each ring page's sequences, lap by lap (ANY_SLOT:
                                                                  # its warp's lap k holds laps[page][k])
    slot_of: dict[int, int] = field(default_factory=dict)         # the ring page a sequence was issued into
    recorded_laps: list[int] | None = None                        # ANY_SLOT: the lap counts the loader records for
                                                                  # the drain (`seq`) once it is done, on every path
    computed: dict[int, int] = field(default_factory=dict)        # (item) -> pages computed
    finished: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.nwc = self.nwc or self.npg
        self.full = [Mbar() for _ in range(self.npg)]
        self.empty = [Mbar(self.page_warps) for _ in range(self.npg)]
        self.desc = [Mbar() for _ in range(self.slots)]
        self.inp = [Mbar() for _ in range(self.slots)]
        self.outs = [Mbar(OUT_ARRIVALS) for _ in range(self.slots)]
        self.free = [Mbar() for _ in range(self.slots)]
        self.page = [(-2, -1)] * self.npg
        self.data = [-1] * self.npg
        self.reading = [0] * self.npg
        self.item_of = [-2] * self.slots
        self.inputs_of = [-1] * self.slots
        self.in_readers = [0] * self.slots
        self.done = [0] * self.slots
        self.seq = [-1] * self.npg
        self.laps = [[] for _ in range(self.npg)]

    def parity(self, j: int) -> int:
        """Item j's phase parity of its slot's barriers (items q, q + slots, ... complete phases 0, 1, ...)."""
        return (j // self.slots) & 1


def until(w: World, cond):
    """A role's wait (pg_wait): yield until cond() holds; False if the step stopped first, when the role returns
    (`if not (yield from until(...)): return`)."""
    while not cond():
        if w.stop:
            return False
        yield
    return True


def _ring_free(w: World, s: int) -> bool:
    """Sequence s's ring page is free: its previous lap's page freed (the first lap waits on nothing)."""
    return s < w.npg or w.empty[s % w.npg].done((s // w.npg - 1) & 1)


def _page_free(w: World, page: int) -> bool:
    """ANY_SLOT: ring page `page`'s last lap freed (the loader lane's test on its own lap count)."""
    n = len(w.laps[page])
    return n == 0 or w.empty[page].done((n - 1) & 1)


def _any_page(w: World):
    """ANY_SLOT: the loader's sweep until some ring page is free: one of them (the kernel: the lowest), or None if the
    step stopped first."""
    while True:
        free = [i for i in range(w.npg) if _page_free(w, i)]
        if free:
            return w.rng.choice(free)
        if w.stop:
            return None
        yield


def _ring_page(w: World, s: int):
    """The loader's wait for sequence s's ring page."""
    return (yield from until(w, lambda: _ring_free(w, s)))


def _issue(w: World, s: int, q: int, p: int, slot: int | None = None) -> None:
    """Sequence s (page p of the item in slot q) into its ring page (s % npg, or ANY_SLOT's `slot`), once the page is
    free: the entry, the copy."""
    slot = s % w.npg if slot is None else slot
    assert w.reading[slot] == 0, "the loader reuses a page a warp is reading"
    w.laps[slot].append(s)
    w.slot_of[s] = slot
    w.page[slot] = (q, p)
    w.full[slot].pending_tx = True
    w.full[slot].arrive()                              # (arrive.expect_tx: completes once the copy lands)
    w.in_flight.append(s)
    w.seq[slot] = s


def _each_when_free(w: World, todo, free, act):
    """Loader lanes each polling their own ring page: act(i) for every i of todo once free(i) holds, in any order (the
    model picks among the free ones at random); False on an abort."""
    todo = list(todo)
    while todo:
        ready = [i for i in todo if free(i)]
        if ready:
            i = w.rng.choice(ready)
            act(i)
            todo.remove(i)
        elif w.stop:
            return False
        yield
    return True


def _rounds(w: World, s: int, n: int, issue):
    """MULTI_ISSUE: sequences s .. s + n - 1 in rounds of at most npg (distinct ring pages), each issued by its own
    lane once its ring page is free, in any order within the round; False on an abort."""
    for base in range(0, n, w.npg):
        if not (yield from _each_when_free(w, range(base, min(n, base + w.npg)), lambda i: _ring_free(w, s + i),
                                           lambda i: issue(s + i, i))):
            return False
    return True


def _end_marker(w: World, s: int, slot: int | None = None) -> None:
    """Sequence s's end marker into its ring page (s % npg, or ANY_SLOT's `slot`), once the page is free: a plain
    arrive."""
    slot = s % w.npg if slot is None else slot
    w.page[slot] = (-1, 0)
    w.full[slot].arrive()
    w.seq[slot] = s
    w.laps[slot].append(s)


def loader(w: World):
    s = 0
    for j in range(len(w.items) + 1):
        q = j % w.slots
        if not (yield from until(w, lambda: j < w.slots or w.free[q].done(w.parity(j - w.slots)))):
            return
        if j == len(w.items):                          # the end item
            w.item_of[q] = END
            w.desc[q].arrive()
            break
        it = w.items[j]
        w.item_of[q] = j
        w.outs[q].arrive(OUT_ARRIVALS - LANES * it.pages * w.page_warps)
        w.desc[q].arrive()
        if w.multi_issue:
            if not (yield from _rounds(w, s, it.pages, lambda sq, p: _issue(w, sq, q, p))):
                return
            s += it.pages
        elif w.any_slot:
            for p in range(it.pages):
                slot = yield from _any_page(w)
                if slot is None:
                    return
                _issue(w, s, q, p, slot)
                s += 1
                yield
        else:
            for p in range(it.pages):
                if not (yield from _ring_page(w, s)):
                    return
                _issue(w, s, q, p)
                s += 1
                w.issued = s
                yield
        if w.claim_late and not (yield from until(w, lambda: w.inp[q].done(w.parity(j)))):
            return
    if w.multi_issue:                                  # (one round: lane i the marker of s + i)
        yield from _rounds(w, s, w.nwc, lambda sq, _i: _end_marker(w, sq))
        return
    if w.any_slot:                                     # (lane i ring page i's marker once its last lap is free)
        marker = itertools.count(s)                    # (the markers' sequence numbers, in the order they go out)
        yield from _each_when_free(w, range(w.npg), lambda i: _page_free(w, i),
                                   lambda i: _end_marker(w, next(marker), i))
        return
    for _ in range(w.nwc):                             # an end marker per computing warp (one per page)
        if not (yield from _ring_page(w, s)):
            return
        _end_marker(w, s)
        s += 1
        w.issued = s
        yield


def loader_role(w: World):
    """The loader warp: its items, then (ANY_SLOT) each ring page's lap count recorded for the closing drain, after
    the end markers or a failed wait alike (the kernel's lanes write `seq` on every path)."""
    yield from loader(w)
    if w.any_slot:
        w.recorded_laps = [len(laps) for laps in w.laps]


def _item_desc(w: World, j: int, role: str):
    """A role's wait, in item order, for item j's description: its slot q, or None at the end item or an abort."""
    q = j % w.slots
    if not (yield from until(w, lambda: w.desc[q].done(w.parity(j)))) or w.item_of[q] == END:
        return None
    assert w.item_of[q] == j, f"the {role} read slot {q} as item {w.item_of[q]}, expected {j}"
    return q


def input_warp(w: World):
    j = 0
    while True:
        q = yield from _item_desc(w, j, "input warp")
        if q is None:
            return
        it = w.items[j]
        if not (yield from until(w, lambda: all(d in w.finished for d in it.deps))):   # its gate/up counter
            return
        assert w.in_readers[q] == 0, "inputs overwritten while a warp reads them"
        w.inputs_of[q] = j
        w.inp[q].arrive()
        yield
        j += 1


def computing_warp(w: World, warp: int):
    k = 0
    if w.page_warps > 1:
        assert w.nwc == w.npg, "shared pages: one warp group per page"
        warp %= w.npg                                  # (its page's other warp: the same sequence numbers)
    while True:
        if w.any_slot:                                 # (ring page `warp`'s lap k, whichever sequence it holds)
            slot, par = warp, k & 1
        else:
            s = warp + k * w.nwc
            slot, par = s % w.npg, (s // w.npg) & 1
        if not (yield from until(w, lambda: w.full[slot].done(par))):
            return
        if w.any_slot:
            s = w.laps[slot][k]                        # (issued: its phase completed)
        q, _ = w.page[slot]
        if q < 0:
            w.empty[slot].arrive()
            return
        j = w.item_of[q]
        if not (yield from until(w, lambda: w.inp[q].done(w.parity(j)))):
            return
        assert w.data[slot] == s, f"page {s} read before its copy landed (holds {w.data[slot]})"
        assert w.inputs_of[q] == j, f"item {j}'s page computed with item {w.inputs_of[q]}'s inputs"
        w.reading[slot] += 1
        w.in_readers[q] += 1
        yield                                          # the page's math
        w.reading[slot] -= 1
        w.in_readers[q] -= 1
        w.computed[j] = w.computed.get(j, 0) + 1
        w.outs[q].arrive(LANES)
        w.empty[slot].arrive()
        w.done[q] += 1
        if w.done[q] == w.items[j].pages * w.page_warps:   # elected (the atomic count): the epilogue
            if not (yield from until(w, lambda: w.outs[q].done(w.parity(j)))):
                return
            yield from _epilogue_and_free(w, j, q, lambda: w.done.__setitem__(q, 0))
        k += 1


def _epilogue(w: World, j: int, q: int) -> None:
    """Item j's epilogue stores (slot q), once its `outs` phase completed: every page computed, its dependencies
    done, and the slot still item j's (its outputs and fields are read here)."""
    assert w.computed[j] == w.items[j].pages * w.page_warps and j not in w.finished
    assert w.item_of[q] == j, "an epilogue read a slot already handed to another item"
    for d in w.items[j].deps:
        assert d in w.finished, "a down item ran before its gate/up item"


def _epilogue_and_free(w: World, j: int, q: int, reset=lambda: None):
    """The epilogue and the item's signal (what a later down item's counter wait sees), then the slot's free (after
    `reset`: the computing warps' page count)."""
    _epilogue(w, j, q)
    w.finished.add(j)
    yield                                              # the stores' and the release's time
    reset()
    w.free[q].arrive()


def run(w: World, rng: random.Random, max_steps: int = 200_000, stop_at: int | None = None) -> None:
    """Random schedules until every role returned; stop_at: the step at which the step is aborted (then every role
    must still return, and every copy issued still lands before the worker's memory is released)."""
    roles = [loader_role(w), input_warp(w)] + [computing_warp(w, k) for k in range(w.nwc * w.page_warps)]
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
            slot = w.slot_of[s]
            assert w.reading[slot] == 0, "a copy lands in a page a warp is reading"
            w.data[slot] = s
            w.full[slot].land()
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
        # the drain waits for the last phase of every page: every copy still in flight is in one (MULTI_ISSUE: each
        # page's recorded last issue, since a failed round may leave holes)
        if w.multi_issue:
            assert all(w.seq[s % w.npg] == s for s in w.in_flight)
            # the drain itself: each page waits for the phase of its recorded last issue; once every copy in flight
            # has landed, each of those waits completes (a wait on a phase never issued, as a count with holes would
            # give, hangs)
            for s in w.in_flight:
                assert not w.full[s % w.npg].done((s // w.npg) & 1), "a copy in flight in a completed phase"
                w.data[s % w.npg] = s
                w.full[s % w.npg].land()
            w.in_flight.clear()
            for page, s in enumerate(w.seq):
                if s >= 0:
                    assert w.full[page].done((s // w.npg) & 1), f"the drain waits on page {page}'s unissued phase"
        elif w.any_slot:
            # each page's drain waits for the phase of its last lap, from the lap counts the loader recorded: every
            # copy still in flight is its page's last lap, which the drain waits for, and that wait completes once
            # the copies land
            assert w.recorded_laps is not None, "the loader left without recording its lap counts"
            assert all(w.laps[w.slot_of[s]][-1] == s for s in w.in_flight), "a copy in flight behind a later lap"
            for s in w.in_flight:
                n = w.recorded_laps[w.slot_of[s]]
                assert n == len(w.laps[w.slot_of[s]]), "the drain would not wait for a copy in flight"
                w.data[w.slot_of[s]] = s
                w.full[w.slot_of[s]].land()
            w.in_flight.clear()
            for page, n in enumerate(w.recorded_laps):
                if n:
                    assert w.full[page].done((n - 1) & 1), f"the drain waits on page {page}'s unissued lap"
        else:
            assert all(s >= w.issued - w.npg for s in w.in_flight)
        return
    assert w.finished == set(range(len(w.items)))
    assert all(w.computed[j] == it.pages * w.page_warps for j, it in enumerate(w.items))


def _snapshot(w: World) -> tuple:
    bars = (w.full, w.empty, w.desc, w.inp, w.outs, w.free)
    return (tuple((m.completed, m.arrived) for b in bars for m in b), tuple(w.page), tuple(w.item_of),
            tuple(w.inputs_of), tuple(w.done), tuple(w.reading), len(w.finished), sum(w.computed.values()))


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


@pytest.mark.parametrize("npg", [4, 5, 6, 9, 12, 14])
def test_paged_worker_protocol_terminates_and_keeps_its_invariants(npg):
    """The kernel's rings of 4..14 pages, a computing warp per page, 0..12 items of every kind; the epilogues by the
    computing warp that counts an item's last page. (The loader's claim lead changes no worker's item order, so this
    model, one worker running its items in claim order, covers it; the simulator's claims_held covers the workers
    together.)"""
    rng = random.Random(npg * 100)
    for trial in range(60):
        items = random_items(rng, rng.randint(0, 12))
        run(World(items, npg), random.Random(trial))


@pytest.mark.parametrize("slots", [2, 4, 5])
@pytest.mark.parametrize("npg", [4, 11, 12])
def test_paged_worker_protocol_with_other_item_slot_counts(npg, slots):
    """MK_PAGE_SLOTS (2..5, build.PAGE_SLOTS_RANGE): the slots' parity (items q, q + slots, ... complete phases 0,
    1, ...) and the free_ waits hold for any count, more slots than a ring's items included."""
    rng = random.Random(npg * 10 + slots)
    for trial in range(40):
        items = random_items(rng, rng.randint(0, 12))
        run(World(items, npg, slots=slots), random.Random(trial))


@pytest.mark.parametrize("npg", [4, 9, 12])
def test_paged_worker_protocol_with_the_late_claim(npg):
    """pg_claim_late: the loader waits for each item's inputs (its dependency) before it goes on: still no deadlock."""
    rng = random.Random(7 + npg)
    for trial in range(60):
        items = random_items(rng, rng.randint(0, 12))
        run(World(items, npg, claim_late=True), random.Random(trial))


@pytest.mark.parametrize("npg", [4, 12])
def test_paged_worker_protocol_leaves_on_an_abort(npg):
    """An aborted step (a counter wait failed) at a random point: every role still returns, whatever it waited on."""
    rng = random.Random(npg)
    for trial in range(60):
        items = random_items(rng, rng.randint(1, 10))
        w = World(items, npg)
        run(w, random.Random(trial), stop_at=rng.randint(0, 400))


def test_the_model_finds_the_parity_ambiguity():
    """More computing warps than pages with parity waits alone (no page per warp): a warp can take a page's previous
    lap for its own and read it before its copy landed (the earlier protocol guarded this with a polled sequence
    number): the model can fail. A page per warp does not."""
    items = [Item("gu", 12) for _ in range(6)]
    with pytest.raises(AssertionError, match="before its copy landed|inputs"):
        for trial in range(200):
            run(World(items, 6, nwc=14), random.Random(trial))
    for trial in range(50):
        run(World(items, 6), random.Random(trial))


@pytest.mark.parametrize("npg", [4, 9, 12])
def test_paged_worker_protocol_with_multi_lane_issue(npg):
    """MK_PG_MULTI_ISSUE: a round's pages issued in any order as their ring pages free (items of more pages than the
    ring in several rounds), and aborted at random points: the invariants hold, every role returns, and the closing
    drain's wait on each page's last issue completes. (The kernel splits a round at the claim: that only narrows the
    issue orders modelled here.)"""
    rng = random.Random(31 + npg)
    for trial in range(60):
        items = random_items(rng, rng.randint(0, 12))
        run(World(items, npg, multi_issue=True, rng=random.Random(trial)), random.Random(trial))
        w = World(items, npg, multi_issue=True, rng=random.Random(trial))
        run(w, random.Random(trial + 1), stop_at=rng.randint(0, 400))


@pytest.mark.parametrize("multi_issue", [False, True])
@pytest.mark.parametrize("npg", [4, 6, 7])
def test_paged_worker_protocol_with_two_warps_per_page(npg, multi_issue):
    """MK_PG_PAGE_WARPS=2 (with 32 KB pages, 6 of them): two computing warps per ring page, both waiting on its `full`
    phase and both freeing it (`empty` counts two), each counted in its item's pages: the loader never reuses a page
    either warp still reads, the epilogue runs once after every page warp, and aborts still let every role return."""
    rng = random.Random(53 + npg)
    for trial in range(60):
        items = random_items(rng, rng.randint(0, 12))
        run(World(items, npg, multi_issue=multi_issue, page_warps=2, rng=random.Random(trial)), random.Random(trial))
        w = World(items, npg, multi_issue=multi_issue, page_warps=2, rng=random.Random(trial))
        run(w, random.Random(trial + 1), stop_at=rng.randint(0, 400))


@pytest.mark.parametrize("page_warps", [1, 2])
@pytest.mark.parametrize("npg", [4, 6, 12])
def test_paged_worker_protocol_with_any_free_ring_page(npg, page_warps):
    """MK_PG_ANY_SLOT: each page, in sequence order, into any ring page free when it is issued (a slow page no longer
    holds the pages behind it), its warp taking that ring page's laps in turn; one and two warps per page, 2-5 item
    slots, with and without the late claim, and aborted at random points: the invariants hold (each lap's page read
    only after its own copy landed), every role returns, and the drain's wait on each page's recorded last lap
    completes."""
    rng = random.Random(71 + npg + page_warps)
    for trial in range(60):
        items = random_items(rng, rng.randint(0, 12))
        kw = dict(any_slot=True, page_warps=page_warps, slots=rng.randint(2, 5), claim_late=rng.random() < 0.3)
        run(World(items, npg, rng=random.Random(trial), **kw), random.Random(trial))
        w = World(items, npg, rng=random.Random(trial), **kw)
        run(w, random.Random(trial + 1), stop_at=rng.randint(0, 400))
