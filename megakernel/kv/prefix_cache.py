"""Prefix caching: reuse the KV blocks of earlier sequences that share a token prefix.

A full block is keyed by a hash chain over token blocks: key(i) = H(key(i-1), tokens of block i), so a key names
the whole prefix up to and including block i. The cache holds one reference on every block it keeps; blocks
whose only holder is the cache are evicted least-recently-used when a pool runs short.

Sliding-window layers: a prefix of k blocks is reusable only if, besides the full-attention blocks 0..k-1, the
sliding group still has the blocks a query at position k*block_size can see. Sliding blocks that fall out of a
running sequence's window are offered to the cache instead of being dropped, so recent prefixes stay reusable.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from megakernel.kv.block_manager import FREED, BlockManager, SequenceBlocks
from megakernel.kv.cache import KVLayout


def extend_hashes(tokens: Sequence[int], block_size: int, num_blocks: int, known: list[bytes]) -> list[bytes]:
    """Extend `known` (the keys of a prefix of the same tokens' full blocks) in place to at least `num_blocks` keys
    and return it, so a growing sequence hashes each block once and a lookup never copies the list."""
    prev = known[-1] if known else b""
    for i in range(len(known), num_blocks):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(b",".join(str(t).encode() for t in tokens[i * block_size:(i + 1) * block_size]))
        prev = h.digest()
        known.append(prev)
    return known


def chain_hashes(tokens: Sequence[int], block_size: int, num_blocks: int) -> list[bytes]:
    """Keys of the first `num_blocks` full blocks of `tokens`."""
    return extend_hashes(tokens, block_size, num_blocks, [])


class PrefixCache:
    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.entries: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in layout.groups]
        self.queried_tokens = 0
        self.hit_tokens = 0

    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def num_cached_blocks(self) -> int:
        return sum(len(e) for e in self.entries)

    # ---- lookup ------------------------------------------------------------------------------------------------
    def attach(self, tokens: Sequence[int], sb: SequenceBlocks, blocks: BlockManager) -> int:
        """Fill the empty block tables `sb` of a sequence of `tokens` with the longest cached prefix (at least one
        token is left to compute). Returns how many tokens' K/V are now in place (0: no hit)."""
        bs = self.layout.block_size
        max_blocks = (len(tokens) - 1) // bs
        if max_blocks == 0:
            return 0
        hashes = extend_hashes(tokens, bs, max_blocks, sb.hashes)
        k = self._longest_hit(hashes, max_blocks, blocks)
        if k == 0:
            return 0
        for g, entries in enumerate(self.entries):
            first = blocks.first_needed_position(g, k * bs) // bs
            table = sb.tables[g]
            for i in range(k):
                if i < first:
                    table.append(FREED)
                    continue
                b = entries[hashes[i]]
                entries.move_to_end(hashes[i])
                blocks.pools[g].incref(b)
                table.append(b)
        return k * bs

    def count(self, num_prompt: int, num_cached: int) -> None:
        """Account one lookup in the hit rate: `num_cached` of a prompt's `num_prompt` tokens were found (the
        scheduler counts a sequence's first admission only, not re-admissions after preemption)."""
        self.queried_tokens += num_prompt
        self.hit_tokens += num_cached

    def _longest_hit(self, hashes: list[bytes], max_blocks: int, blocks: BlockManager) -> int:
        bs = self.layout.block_size
        k = 0
        full = [g for g, grp in enumerate(self.layout.groups) if grp.window is None]
        while k < max_blocks and all(hashes[k] in self.entries[g] for g in full):
            k += 1
        # Shrink until every windowed group holds what a query at k*bs sees.
        while k > 0:
            ok = True
            for g, grp in enumerate(self.layout.groups):
                if grp.window is None:
                    continue
                first = blocks.first_needed_position(g, k * bs) // bs
                if not all(hashes[i] in self.entries[g] for i in range(first, k)):
                    ok = False
                    break
            if ok:
                return k
            k -= 1
        return 0

    # ---- insertion ---------------------------------------------------------------------------------------------
    def offer(self, tokens: Sequence[int], sb: SequenceBlocks, g: int, index: int, block: int,
              blocks: BlockManager) -> None:
        """Keep block `index` of group g of a sequence of `tokens` with tables `sb` (the block must be full and
        computed) for later reuse."""
        key = extend_hashes(tokens, self.layout.block_size, index + 1, sb.hashes)[index]
        self._insert(g, key, block, blocks)

    def release(self, tokens: Sequence[int], sb: SequenceBlocks, num_ready: int, blocks: BlockManager) -> None:
        """Before a sequence gives its blocks back: keep every full block among its first `num_ready` tokens
        (computed, and with every value known: a token still in flight is a placeholder)."""
        bs = self.layout.block_size
        n_full = num_ready // bs
        if n_full == 0:
            return
        hashes = extend_hashes(tokens, bs, n_full, sb.hashes)
        for g, table in enumerate(sb.tables):
            for i in range(min(n_full, len(table))):
                if table[i] != FREED:
                    self._insert(g, hashes[i], table[i], blocks)

    def _insert(self, g: int, key: bytes, block: int, blocks: BlockManager) -> None:
        entries = self.entries[g]
        if key in entries:
            entries.move_to_end(key)
            return
        entries[key] = block
        blocks.pools[g].incref(block)

    # ---- eviction ----------------------------------------------------------------------------------------------
    def evict(self, g: int, n: int, blocks: BlockManager) -> int:
        """Drop up to n least-recently-used blocks of group g that nobody but the cache holds. Walks from the LRU
        end only as far as it needs (a full cache is not copied or scanned for one block)."""
        pool = blocks.pools[g]
        entries = self.entries[g]
        victims = []
        if n > 0:
            for key, b in entries.items():
                if pool.refcount[b] == 1:
                    victims.append(key)
                    if len(victims) == n:
                        break
        for key in victims:
            pool.release(entries.pop(key))
        return len(victims)

    def num_evictable(self, blocks: BlockManager) -> int:
        return sum(1 for g, e in enumerate(self.entries) for b in e.values() if blocks.pools[g].refcount[b] == 1)

    def clear(self, blocks: BlockManager) -> None:
        for g, entries in enumerate(self.entries):
            for b in entries.values():
                blocks.pools[g].release(b)
            entries.clear()
