"""Block allocation for the paged KV cache: free lists, per-sequence block tables, window recycling.

Every allocation is all-or-nothing: when a pool cannot satisfy it, `OutOfKVBlocks` is raised before anything
changes, so the caller can preempt or wait and retry with the pool intact.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from megakernel.errors import OutOfKVBlocks
from megakernel.kv.cache import KVLayout

FREED = -1   # block-table entry of a sliding-window block already given back


class BlockPool:
    """Free list and reference counts of one group's blocks (refcounts let prefix caching share blocks)."""

    def __init__(self, name: str, num_blocks: int) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise OutOfKVBlocks(self.name, n, len(self.free_ids))
        ids = [self.free_ids.popleft() for _ in range(n)]
        for i in ids:
            self.refcount[i] = 1
        return ids

    def incref(self, block: int) -> None:
        self.refcount[block] += 1

    def release(self, block: int) -> None:
        assert self.refcount[block] > 0, f"double free of block {block} in pool {self.name}"
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free_ids.append(block)


@dataclass
class SequenceBlocks:
    """Block tables of one sequence: tables[g][i] holds positions [i*bs, (i+1)*bs) of group g (or FREED)."""

    tables: list[list[int]] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)   # prefix-cache keys of its full blocks, computed once
    # per group: every entry of tables[g] before this index is FREED (window recycling resumes there, so a step
    # looks only at the blocks that just left the window, not at the whole table)
    recycled: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.recycled += [0] * (len(self.tables) - len(self.recycled))


class Evictor(Protocol):
    """What a block manager asks for blocks when a pool runs short (the prefix cache)."""

    def evict(self, g: int, n: int, blocks: "BlockManager") -> int:
        """Free up to n blocks of group g that only the evictor holds; returns how many it freed."""
        ...


class BlockManager:
    def __init__(self, layout: KVLayout, num_blocks: list[int], evictor: Evictor | None = None) -> None:
        self.layout = layout
        self.pools = [BlockPool(g.name, n) for g, n in zip(layout.groups, num_blocks)]
        self.evictor = evictor      # asked for blocks before an allocation fails

    def new_sequence(self) -> SequenceBlocks:
        return SequenceBlocks(tables=[[] for _ in self.pools])

    def first_needed_position(self, g: int, start: int) -> int:
        """Oldest key position a query at position >= start can still see in group g."""
        w = self.layout.groups[g].window
        return 0 if w is None else max(0, start - w + 1)

    def blocks_needed(self, seq: SequenceBlocks, end: int) -> list[int]:
        """New blocks each group must allocate so positions < end are backed."""
        target = math.ceil(end / self.layout.block_size)
        return [max(0, target - len(t)) for t in seq.tables]

    def prepare(self, seq: SequenceBlocks, start: int, end: int) -> None:
        """Back positions [start, end) with blocks, first recycling blocks no query >= start can see.

        Raises OutOfKVBlocks (and changes nothing but the recycling, which is always safe) if a pool is short.
        """
        self.recycle(seq, start)
        needed = self.blocks_needed(seq, end)
        for g, (pool, n) in enumerate(zip(self.pools, needed)):
            if n > pool.num_free and self.evictor is not None:
                self.evictor.evict(g, n - pool.num_free, self)
            if n > pool.num_free:
                raise OutOfKVBlocks(pool.name, n, pool.num_free)
        for pool, table, n in zip(self.pools, seq.tables, needed):
            table.extend(pool.allocate(n))

    def recycle(self, seq: SequenceBlocks, start: int, keep: Callable[[int, int, int], None] | None = None) -> int:
        """Give back sliding-window blocks that no query at position >= start can see. Returns how many.

        `keep(group, index, block)` is called first for each, so a prefix cache can hold on to it.
        """
        freed = 0
        for g, (pool, table) in enumerate(zip(self.pools, seq.tables)):
            if self.layout.groups[g].window is None:
                continue
            keep_from = min(self.first_needed_position(g, start) // self.layout.block_size, len(table))
            for i in range(seq.recycled[g], keep_from):
                if table[i] != FREED:
                    if keep is not None:
                        keep(g, i, table[i])
                    pool.release(table[i])
                    table[i] = FREED
                    freed += 1
            seq.recycled[g] = max(seq.recycled[g], keep_from)
        return freed

    def free(self, seq: SequenceBlocks) -> None:
        for g, (pool, table) in enumerate(zip(self.pools, seq.tables)):
            for b in table:
                if b != FREED:
                    pool.release(b)
            table.clear()
            seq.recycled[g] = 0

    def all_free(self) -> bool:
        return all(p.num_free == p.num_blocks for p in self.pools)
