"""Scheduler behaviour the server relies on, checked on the engine directly (fast, in-process):
chunked prefill interleaved with decodes, requests joining and leaving at step boundaries, aborts freeing blocks,
prefix caching with sliding-window layers, LRU eviction under pressure, and a randomized stress run (ragged
lengths, n > 1, aborts, preemption) whose greedy outputs must equal the solo runs and which must end with every
KV block free. Also the AsyncEngine thread wrapper: a consumer that stops early aborts its request."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from megakernel import EngineArgs, LLMEngine, SamplingParams
from tiny_models import write_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls: one intra-op thread is faster and immune to a busy (shared) CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint("north_like", tmp_path_factory.mktemp("sched"))   # sliding window 8


def _engine(folder, **kw) -> LLMEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("num_kv_blocks", [256, 256])
    return LLMEngine(EngineArgs(model=str(folder), device="cpu", backend="torch", progress=False, **kw))


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _run_all(eng: LLMEngine) -> dict:
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _solo(folder, prompt, max_tokens, **kw) -> list[int]:
    eng = _engine(folder, **kw)
    eng.add_request("solo", prompt, _greedy(max_tokens))
    return _run_all(eng)["solo"].token_ids


def _all_free(eng: LLMEngine) -> bool:
    assert eng.num_kv_blocks_in_use() == 0
    pc = eng.scheduler.prefix_cache
    if pc is not None:
        pc.clear(eng.blocks)
    return eng.blocks.all_free()


def test_chunked_prefill_never_stalls_decodes(folder):
    """A long prompt is prefilled in chunks while a running stream still gets one token every step."""
    eng = _engine(folder, max_num_batched_tokens=16)
    rng = random.Random(0)
    eng.add_request("a", _prompt(rng, 5), _greedy(40))
    while not eng.step():
        pass
    n_a = 1
    eng.add_request("long", _prompt(rng, 100), _greedy(4))
    steps = 0
    long_started = False
    while not long_started:
        outs = {o.request_id: o for o in eng.step()}
        steps += 1
        assert "a" in outs and len(outs["a"].token_ids) == n_a + 1, "the running stream stalled"
        n_a += 1
        long_started = "long" in outs
    # 100 prompt tokens at 15 per step (16 minus the decode token): 7 steps, each a chunk, none skipped; a step's
    # tokens are read back during the next step when steps are pipelined
    assert steps == 7 + (1 if eng.args.async_scheduling else 0)
    _run_all(eng)
    assert _all_free(eng)


def test_prefill_chunk_is_smaller_while_streams_decode(folder):
    """With `prefill_with_decodes`, a step that carries decode rows prefills at most that many tokens; alone, a
    prompt gets the whole step budget."""
    eng = _engine(folder, max_num_batched_tokens=32, prefill_with_decodes=8)
    rng = random.Random(1)
    eng.add_request("alone", _prompt(rng, 70), _greedy(2))
    chunks = eng.scheduler.schedule()
    assert [c.end - c.start for c in chunks] == [32]          # no decodes: the full budget
    eng.abort_request("alone")
    eng.add_request("a", _prompt(rng, 5), _greedy(40))
    while not eng.step():
        pass
    eng.add_request("long", _prompt(rng, 70), _greedy(2))
    sizes, run = [], eng.runner.run

    def spy(chunks):
        sizes.append({c.seq.request_id: c.end - c.start for c in chunks})
        return run(chunks)

    eng.runner.run = spy
    while not any(o.request_id == "long" and o.finished for o in eng.step()):
        pass
    prefill = [s["long"] for s in sizes if s.get("long", 1) > 1]
    assert all(s.get("a") == 1 for s in sizes) and prefill == [8] * 8 + [6], sizes   # 70 tokens in chunks of 8


def test_requests_join_and_leave_at_step_boundaries(folder):
    eng = _engine(folder)
    rng = random.Random(1)
    prompts = {f"r{i}": (_prompt(rng, rng.randint(3, 30)), rng.randint(2, 12)) for i in range(6)}
    solo = {rid: _solo(folder, p, mt) for rid, (p, mt) in prompts.items()}
    pending = list(prompts)
    done = {}
    step = 0
    while pending or eng.has_unfinished_requests():
        if pending and step % 3 == 0:       # a new request every third step, joining a running batch
            rid = pending.pop(0)
            eng.add_request(rid, prompts[rid][0], _greedy(prompts[rid][1]))
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        step += 1
    assert done == solo
    assert _all_free(eng)


def test_abort_frees_blocks_running_and_waiting(folder):
    eng = _engine(folder, max_num_seqs=2)
    rng = random.Random(2)
    for i in range(4):
        eng.add_request(f"r{i}", _prompt(rng, 40), _greedy(50, n=2))
    for _ in range(5):
        eng.step()
    assert eng.num_kv_blocks_in_use() > 0
    for i in range(4):
        eng.abort_request(f"r{i}")
    assert not eng.has_unfinished_requests()
    assert eng.step() == []
    assert _all_free(eng)


def test_prefix_cache_with_sliding_window_and_lru(folder):
    rng = random.Random(3)
    shared = _prompt(rng, 45)               # > the sliding window: a hit needs the sliding blocks near the end
    tails = [_prompt(rng, 7) for _ in range(3)]
    cold = {i: _solo(folder, shared + t, 10, enable_prefix_caching=False) for i, t in enumerate(tails)}
    eng = _engine(folder, num_kv_blocks=[40, 24])     # small pools: cached blocks must be evicted LRU
    got = {}
    cached = {}
    for rnd in range(2):
        for i, t in enumerate(tails):
            eng.add_request(f"{rnd}-{i}", shared + t, _greedy(10))
            out = _run_all(eng)[f"{rnd}-{i}"]
            got[(rnd, i)] = out.token_ids
            cached[(rnd, i)] = out.num_cached_tokens
        # unrelated traffic pushes the shared prefix towards eviction
        eng.add_request(f"noise{rnd}", _prompt(rng, 60), _greedy(30))
        _run_all(eng)
    for (rnd, i), toks in got.items():
        assert toks == cold[i], f"round {rnd} prompt {i} differs with prefix caching"
    assert cached[(0, 0)] == 0 and cached[(0, 1)] >= 40 and cached[(0, 2)] >= 40
    assert eng.scheduler.prefix_cache.hit_rate() > 0
    assert _all_free(eng)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_randomized_stress_preemption_aborts_n(folder, seed):
    """Ragged prompts, n > 1, staggered arrivals, random aborts and a pool small enough to preempt often."""
    rng = random.Random(100 + seed)
    reqs = {}
    for i in range(20):
        prompt = _prompt(rng, rng.choice((3, 9, 17, 33, 60)))
        if i % 4 == 3:           # share prefixes with an earlier request
            prompt = reqs[f"r{i - 3}"][0][:rng.randint(8, 30)] + _prompt(rng, 5)
        reqs[f"r{i}"] = (prompt, rng.randint(3, 30), rng.choice((1, 1, 2)))
    solo = {}
    for rid, (p, mt, n) in reqs.items():
        solo[rid] = _solo(folder, p, mt)
    eng = _engine(folder, num_kv_blocks=[36, 20], max_num_seqs=6, max_num_batched_tokens=24)
    to_abort = {rid for rid in reqs if rng.random() < 0.2}
    order = list(reqs)
    done = {}
    step = 0
    while order or eng.has_unfinished_requests():
        if order and step % 2 == 0:
            rid = order.pop(0)
            p, mt, n = reqs[rid]
            eng.add_request(rid, p, _greedy(mt, n=n))
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if step == 12:
            for rid in to_abort:
                eng.abort_request(rid)
        step += 1
    assert eng.scheduler.num_preemptions > 0, "the pool was big enough: no preemption exercised"
    for rid, out in done.items():
        for o in out.outputs:       # every completion of n equals the solo greedy run
            assert o.token_ids == solo[rid], f"{rid}[{o.index}] differs from its solo run"
    assert set(done) | to_abort == set(reqs)
    assert _all_free(eng)


def test_async_engine_abort_on_consumer_exit(folder):
    from megakernel.server.async_engine import AsyncEngine

    eng = _engine(folder)
    ae = AsyncEngine(eng)
    ae.start()
    rng = random.Random(5)

    async def main():
        outs = []
        agen = ae.generate("keep", _prompt(rng, 10), _greedy(8))
        gone = ae.generate("gone", _prompt(rng, 10), _greedy(200))
        n = 0
        async for _ in gone:                    # read two snapshots, then walk away
            n += 1
            if n == 2:
                break
        await gone.aclose()
        async for out in agen:
            outs.append(out)
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].token_ids) == 8
    for _ in range(100):
        if not eng.has_unfinished_requests():
            break
        import time

        time.sleep(0.02)
    ae.shutdown()
    assert not eng.has_unfinished_requests()
    assert _all_free(eng)


def test_async_engine_survives_a_request_that_cannot_fit(folder):
    """A sequence that outgrows the whole KV pool is ended ("length" if it produced tokens, an error if not);
    the engine thread keeps serving the others."""
    from megakernel.errors import RequestError
    from megakernel.server.async_engine import AsyncEngine, RequestFailed

    eng = _engine(folder, num_kv_blocks=[12, 12], max_model_len=256)     # 48 tokens of full-attention KV
    ae = AsyncEngine(eng)
    ae.start()
    rng = random.Random(6)

    async def last(rid, prompt, mt):
        out = None
        async for out in ae.generate(rid, prompt, _greedy(mt)):
            pass
        return out

    async def main():
        grows = await last("grows", _prompt(rng, 30), 100)            # fits at first, outgrows the pool
        with pytest.raises((RequestFailed, RequestError)):
            await last("huge", _prompt(rng, 80), 5)                    # never fits
        ok = await last("ok", _prompt(rng, 10), 5)
        return grows, ok

    grows, ok = asyncio.run(main())
    ae.shutdown()
    assert grows.finished and grows.outputs[0].finish_reason == "length" and 0 < len(grows.token_ids) < 100
    assert ok.finished and len(ok.token_ids) == 5
    assert _all_free(eng)
