"""Block pool invariants: allocation is all-or-nothing, freeing restores the pool, windows bound memory."""

from __future__ import annotations

import math
import random

import pytest

from megakernel.config import north_mini_code_config
from megakernel.errors import OutOfKVBlocks
from megakernel.kv.block_manager import FREED, BlockManager
from megakernel.kv.cache import KVLayout, plan_num_blocks
from megakernel.kv.prefix_cache import PrefixCache, chain_hashes

import torch


def layout(window=16, block_size=4) -> KVLayout:
    from megakernel.kv.cache import KVGroup

    return KVLayout(block_size, (KVGroup("full", None, (0, 4)), KVGroup("sliding", window, (1, 2, 3))), 2, 8)


def test_allocate_and_free_restore_the_pool():
    bm = BlockManager(layout(), [64, 64])
    rng = random.Random(0)
    seqs = []
    for _ in range(200):
        if seqs and rng.random() < 0.4:
            bm.free(seqs.pop(rng.randrange(len(seqs))))
            continue
        s = bm.new_sequence()
        n = rng.randint(1, 40)
        try:
            bm.prepare(s, 0, n)
            seqs.append(s)
        except OutOfKVBlocks:
            assert s.tables == [[], []]          # nothing was taken
    for s in seqs:
        bm.free(s)
    assert bm.all_free()
    assert all(sorted(p.free_ids) == list(range(p.num_blocks)) for p in bm.pools)


def test_sliding_window_recycling_bounds_memory():
    bs, window = 4, 16
    bm = BlockManager(layout(window, bs), [1000, 1000])
    s = bm.new_sequence()
    most_live = 0
    for pos in range(0, 10 * window):          # decode one token at a time, far past the window
        bm.prepare(s, pos, pos + 1)
        live = sum(1 for b in s.tables[1] if b != FREED)
        most_live = max(most_live, live)
        # every position a query at `pos` can see is still backed
        for p in range(max(0, pos - window + 1), pos + 1):
            assert s.tables[1][p // bs] != FREED
    assert most_live <= math.ceil(window / bs) + 1
    assert len([b for b in s.tables[0] if b != FREED]) == math.ceil(10 * window / bs)   # full layers keep all
    bm.free(s)
    assert bm.all_free()


def test_out_of_blocks_is_recoverable():
    bm = BlockManager(layout(), [8, 8])
    a, b = bm.new_sequence(), bm.new_sequence()
    bm.prepare(a, 0, 24)                       # 6 blocks in each pool
    free_before = [p.num_free for p in bm.pools]
    with pytest.raises(OutOfKVBlocks) as e:
        bm.prepare(b, 0, 24)
    assert "out of KV blocks" in str(e.value)
    assert [p.num_free for p in bm.pools] == free_before and b.tables == [[], []]
    bm.free(a)
    bm.prepare(b, 0, 24)                       # a later request succeeds
    bm.free(b)
    assert bm.all_free()


def test_double_free_is_caught():
    bm = BlockManager(layout(), [8, 8])
    s = bm.new_sequence()
    bm.prepare(s, 0, 4)
    block = s.tables[0][0]
    bm.pools[0].release(block)
    with pytest.raises(AssertionError):
        bm.pools[0].release(block)


def test_plan_gives_sliding_layers_at_most_a_window_per_sequence():
    cfg = north_mini_code_config()
    lay = KVLayout.for_model(cfg, 64)
    assert [g.name for g in lay.groups] == ["full", "sliding"] and len(lay.groups[0].layers) == 13
    n = plan_num_blocks(lay, 40 << 30, torch.bfloat16, max_num_seqs=8, max_model_len=262144, chunk=512)
    assert n[1] == 8 * lay.blocks_per_seq(1, 262144, 512)
    used = sum(k * lay.block_bytes(g, torch.bfloat16) for g, k in enumerate(n))
    assert used <= 40 << 30


def test_prefix_cache_shares_blocks_and_evicts_lru():
    lay = layout(window=8, block_size=4)
    pc = PrefixCache(lay)
    bm = BlockManager(lay, [16, 16], evictor=pc)

    a_tokens, a = list(range(20)), bm.new_sequence()
    bm.prepare(a, 0, 20)
    a_full_blocks = list(a.tables[0])
    pc.release(a_tokens, a, 20, bm)
    bm.free(a)
    assert pc.num_cached_blocks() == 10          # 5 full blocks in each group

    b_tokens, b = list(range(18)) + [99, 98], bm.new_sequence()        # shares 4 full blocks (16 tokens)
    assert pc.attach(b_tokens, b, bm) == 16
    assert b.tables[0] == a_full_blocks[:4]
    # the sliding group only gets the blocks a query at position 16 can see (window 8: positions 9..)
    assert b.tables[1][:2] == [FREED, FREED]
    assert chain_hashes(b_tokens, 4, 4) == chain_hashes(a_tokens, 4, 4)
    bm.free(b)

    # Pressure: a big allocation evicts cached blocks nobody else holds.
    c = bm.new_sequence()
    bm.prepare(c, 0, 64)
    assert pc.num_cached_blocks() < 10
    bm.free(c)
    pc.clear(bm)
    assert bm.all_free()
