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

from megakernel.kv.block_manager import FREED, BlockManager, SequenceBlocks
from megakernel.kv.cache import KVLayout


def chain_hashes(tokens: list[int], block_size: int, num_blocks: int, known: list[bytes] | None = None
                 ) -> list[bytes]:
    """Keys of the first `num_blocks` full blocks of `tokens`; `known` (keys already computed for a prefix of the
    same tokens) is extended in place, so a growing sequence hashes each block once."""
    out = known if known is not None else []
    prev = out[-1] if out else b""
    for i in range(len(out), num_blocks):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(b",".join(str(t).encode() for t in tokens[i * block_size:(i + 1) * block_size]))
        prev = h.digest()
        out.append(prev)
    return out[:num_blocks]


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
    def attach(self, seq, blocks: BlockManager) -> None:
        """Give a new sequence the longest cached prefix of its tokens (at least one token is left to compute)."""
        bs = self.layout.block_size
        tokens = seq.token_ids
        max_blocks = (len(tokens) - 1) // bs
        if max_blocks == 0:
            return
        hashes = self._keys(seq, max_blocks)
        k = self._longest_hit(hashes, blocks)
        if k == 0:
            return
        sb: SequenceBlocks = seq.blocks
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
        seq.num_computed = k * bs
        seq.num_cached_prompt = min(k * bs, len(seq.prompt_token_ids))

    def count(self, seq) -> None:
        """Account an admitted sequence's lookup in the hit rate (its first admission only, not re-admissions
        after preemption)."""
        if seq.num_preemptions:
            return
        self.queried_tokens += len(seq.prompt_token_ids)
        self.hit_tokens += seq.num_cached_prompt

    def _longest_hit(self, hashes: list[bytes], blocks: BlockManager) -> int:
        bs = self.layout.block_size
        k = 0
        full = [g for g, grp in enumerate(self.layout.groups) if grp.window is None]
        while k < len(hashes) and all(hashes[k] in self.entries[g] for g in full):
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

    def _keys(self, seq, n: int) -> list[bytes]:
        """seq's first n block keys, memoised on its block tables (its tokens only ever grow)."""
        return chain_hashes(seq.token_ids, self.layout.block_size, n, seq.blocks.hashes)

    # ---- insertion ---------------------------------------------------------------------------------------------
    def offer(self, seq, g: int, index: int, block: int, blocks: BlockManager) -> None:
        """Keep block `index` of group g of seq (which must be full and computed) for later reuse."""
        key = self._keys(seq, index + 1)[index]
        self._insert(g, key, block, blocks)

    def release(self, seq, blocks: BlockManager) -> None:
        """Before a sequence gives its blocks back: keep every full, computed block it holds."""
        bs = self.layout.block_size
        # only blocks whose tokens are all known (a token still in flight is a placeholder)
        known = len(seq.token_ids) - len(getattr(seq, "pending", ()))
        n_full = min(seq.num_computed, known) // bs
        if n_full == 0:
            return
        hashes = self._keys(seq, n_full)
        for g, table in enumerate(seq.blocks.tables):
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
        """Drop up to n least-recently-used blocks of group g that nobody but the cache holds."""
        pool = blocks.pools[g]
        entries = self.entries[g]
        freed = 0
        for key in list(entries):
            if freed >= n:
                break
            b = entries[key]
            if pool.refcount[b] == 1:
                del entries[key]
                pool.release(b)
                freed += 1
        return freed

    def num_evictable(self, blocks: BlockManager) -> int:
        return sum(1 for g, e in enumerate(self.entries) for b in e.values() if blocks.pools[g].refcount[b] == 1)

    def clear(self, blocks: BlockManager) -> None:
        for g, entries in enumerate(self.entries):
            for b in entries.values():
                blocks.pools[g].release(b)
            entries.clear()
