"""Host work per step grows with what is new, not with the context: the pieces that made it O(everything so far)
(the prompt+output concatenation, the per-step snapshot copy, window recycling from block 0) and what replaced
them, checked for the same results."""

from __future__ import annotations

import pytest
import torch

from megakernel import LLM, SamplingParams
from megakernel.engine.list_view import ListView
from megakernel.engine.sequence import PLACEHOLDER, Sequence
from megakernel.engine.scheduler import Scheduler
from megakernel.kv.block_manager import FREED, BlockManager, SequenceBlocks
from megakernel.kv.cache import KVGroup, KVLayout
from megakernel.kv.prefix_cache import PrefixCache
from tiny_models import write_checkpoint


def test_list_view_behaves_like_the_list_it_shows():
    items = list(range(10))
    live, fixed = ListView(items, 3), ListView(items, 3, 7)
    assert len(live) == 7 and len(fixed) == 4
    assert fixed == [3, 4, 5, 6] and [3, 4, 5, 6] == fixed and fixed == (3, 4, 5, 6) and fixed != [3, 4, 5]
    assert fixed[0] == 3 and fixed[-1] == 6 and fixed[1:3] == [4, 5] and fixed[::-1] == [6, 5, 4, 3]
    assert fixed[5:] == [] and list(fixed) == [3, 4, 5, 6] and repr(fixed) == "[3, 4, 5, 6]"
    with pytest.raises(IndexError):
        fixed[4]
    items.append(10)
    assert len(live) == 8 and live[-1] == 10 and fixed == [3, 4, 5, 6]     # a fixed view is a snapshot
    assert ListView(items, 0, 0) == [] and not ListView(items, 0, 0)


def _seq(prompt: list[int]) -> Sequence:
    return Sequence("r", 0, prompt, SamplingParams(), SequenceBlocks())


def test_sequence_keeps_prompt_and_output_in_one_list():
    prompt = [5, 6, 7]
    seq = _seq(prompt)
    assert seq.token_ids == [5, 6, 7] and seq.token_ids is not prompt and seq.num_output == 0
    assert seq.append_output(PLACEHOLDER) == 0 and seq.append_output(PLACEHOLDER) == 1
    seq.set_output(0, 9)
    assert seq.token_ids == [5, 6, 7, 9, PLACEHOLDER] and seq.output_token_ids == [9, PLACEHOLDER]
    assert len(seq) == 5 and seq.num_prompt == 3 and seq.prompt_token_ids == [5, 6, 7]
    seq.truncate_output(1)
    assert seq.token_ids == [5, 6, 7, 9] and seq.output_token_ids == [9] and prompt == [5, 6, 7]
    with pytest.raises(AttributeError):
        seq.output_token_ids.append(3)       # read-only: output tokens change only through the methods


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint("north_like", tmp_path_factory.mktemp("north_like"))


def test_running_snapshots_are_views_that_never_change(folder):
    """Each step's snapshot of a running request shares the sequence's token list (no copy), and what a snapshot
    shows stays as it was while the engine goes on (tokens resolved later, tokens in flight dropped at the end);
    a finished request's outputs are plain lists equal to the last views."""
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16, progress=False)
    eng = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True, n=2)]
    for i, p in enumerate(params):
        eng.add_request(f"r{i}", [3 + i, 4, 5, 6, 7, 8, 9], p)
    seen: list[tuple[object, list, list | None]] = []
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            for o in out.outputs:
                seen.append((o, list(o.token_ids), list(o.logprobs) if o.logprobs is not None else None))
                if o.finish_reason is None:
                    seq = eng.requests[out.request_id].seqs[o.index]
                    assert isinstance(o.token_ids, ListView) and o.token_ids._items is seq.token_ids
                    assert PLACEHOLDER not in o.token_ids
            if out.finished:
                finals[out.request_id] = out
    eng.drain()
    assert len(seen) > 20
    for o, ids, lps in seen:
        assert o.token_ids == ids and (lps is None or o.logprobs == lps)
    for out in finals.values():
        for o in out.outputs:
            assert type(o.token_ids) is list and (o.logprobs is None or type(o.logprobs) is list)
    assert [len(o.token_ids) for o in finals["r0"].outputs] == [30]
    assert [len(o.token_ids) for o in finals["r1"].outputs] == [12, 12]


class _Untouchable:
    """A block-table entry that fails any comparison: recycling must never look at it again."""

    def __ne__(self, other):
        raise AssertionError("recycle looked at a block it had already given back")

    __eq__ = __ne__


def _layout(window=8, bs=4) -> KVLayout:
    return KVLayout(bs, (KVGroup("full", None, (0,)), KVGroup("sliding", window, (1,))), 1, 8)


def test_recycle_resumes_where_it_stopped():
    """Window recycling looks only at blocks that just left the window: entries it freed before are not read
    again (on a 256K context the scan from block 0 cost 1.1 ms per step at batch 16)."""
    lay = _layout()
    bm = BlockManager(lay, [64, 64])
    sb = bm.new_sequence()
    bm.prepare(sb, 0, 40)                                    # 10 blocks per group
    kept: list[tuple[int, int]] = []
    keep = lambda g, i, b: kept.append((g, i))              # noqa: E731
    assert bm.recycle(sb, 20, keep) == 3                     # a query at 20 sees 13..: blocks 0..2 go
    assert kept == [(1, 0), (1, 1), (1, 2)] and sb.tables[1][:4].count(FREED) == 3 and sb.recycled == [0, 3]
    for i in range(3):
        sb.tables[1][i] = _Untouchable()                     # the old scan from block 0 fails here
    assert bm.recycle(sb, 20, keep) == 0
    assert bm.recycle(sb, 33, keep) == 3 and kept[3:] == [(1, 3), (1, 4), (1, 5)]
    for i in range(3):
        sb.tables[1][i] = FREED
    bm.free(sb)
    assert bm.all_free() and sb.recycled == [0, 0]


def _cache_a_sequence(tokens: list[int]) -> tuple[PrefixCache, BlockManager, list[int]]:
    """A prefix cache holding every full block of one finished sequence of `tokens`; returns the cache, the block
    manager and that sequence's full-attention blocks."""
    pc = PrefixCache(_layout())
    bm = BlockManager(pc.layout, [64, 64], evictor=pc)
    sb = bm.new_sequence()
    bm.prepare(sb, 0, len(tokens))
    pc.release(tokens, sb, len(tokens), bm)
    full = list(sb.tables[0])
    bm.free(sb)
    return pc, bm, full


def test_recycle_of_tables_filled_from_a_cached_prefix():
    """Tables that start with FREED entries (a prefix-cache hit, a synthetic KV fill) recycle like grown ones."""
    pc, bm, _ = _cache_a_sequence(list(range(40)))
    b_tokens, b = list(range(36)) + [99, 98, 97, 96], bm.new_sequence()
    assert pc.attach(b_tokens, b, bm) == 36
    assert b.tables[1][:7] == [FREED] * 7 and b.recycled == [0, 0]
    bm.prepare(b, 36, 40)
    assert bm.recycle(b, 39) == 1 and b.recycled[1] == 8 and b.tables[1][:8] == [FREED] * 8
    bm.free(b)
    pc.clear(bm)
    assert bm.all_free()


def test_scheduler_refuses_a_prefix_cache_the_blocks_do_not_evict_from():
    lay = _layout()
    pc = PrefixCache(lay)
    with pytest.raises(ValueError, match="evict"):
        Scheduler(BlockManager(lay, [8, 8]), 4, 16, pc)
    assert Scheduler(BlockManager(lay, [8, 8], evictor=pc), 4, 16, pc).prefix_cache is pc


@pytest.mark.slow
def test_host_step_time_is_flat_in_the_context():
    """benchmarks/host_step.py at 1K and 64K-token prompts (16 sequences, stub model): the fastest decode step
    at 64K within 2x of the fastest at 1K (before this was O(context), 64K took about 8x as long)."""
    from benchmarks.host_step import run_point

    torch.set_num_threads(1)
    small, large = run_point(16, 1024, steps=24), run_point(16, 65536, steps=24)
    assert large["ms_per_step_min"] < 2 * small["ms_per_step_min"], (small, large)


def test_eviction_walks_only_as_far_as_it_needs():
    """Evicting a block for one allocation takes the least recently used blocks nobody else holds, without
    copying the whole cache's key list first (at a few thousand cached blocks that copy cost 0.5 ms per step)."""
    from collections import OrderedDict

    class NoFullCopy(OrderedDict):
        def __iter__(self):
            raise AssertionError("evict copied the whole cache")

    pc, bm, full = _cache_a_sequence(list(range(40)))
    held = full[0]
    bm.pools[0].incref(held)                      # someone still uses the least recently used block
    pc.entries[0] = NoFullCopy(pc.entries[0])
    lru = list(dict.keys(pc.entries[0]))
    assert pc.evict(0, 2, bm) == 2
    assert list(dict.keys(pc.entries[0])) == [lru[0]] + lru[3:]      # the held one stays, the next two go
    bm.pools[0].release(held)
