"""Pipelined steps (the host prepares step t+1 while the device runs step t) change nothing a caller can see.

The engine reads a step's tokens back during the next step; a sequence enters step t+1 with its step-t token
still on the device, and stop conditions are checked one step late. These tests compare it with the synchronous
engine (async_scheduling=False) on the embedded model, on every sampling option whose state crosses steps, with
and without preemption, and check that a decode failure found only at read-back fails just its requests.
"""

from __future__ import annotations

import pytest

from megakernel import LLM, SamplingParams
from megakernel.errors import MegakernelError
from megakernel.model.decode_backend import DecodeBackend, TorchDecodeBackend
from sampling_cases import PROMPTS, stateful_params
from tiny_models import write_checkpoint

def _run(async_scheduling: bool, **kw):
    llm = LLM(device="cpu", dtype="float32", progress=False, async_scheduling=async_scheduling, **kw)
    outs = llm.generate(PROMPTS, stateful_params(), use_tqdm=False)
    llm.engine.drain()
    assert llm.engine.num_kv_blocks_in_use() == 0
    return llm, [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                   [(lp.token_id, round(lp.logprob, 5), sorted(lp.top)) for lp in c.logprobs or []])
                  for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def synchronous():
    return _run(False)[1]


def test_pipelined_equals_synchronous(synchronous):
    llm, outs = _run(True)
    assert llm.engine.args.async_scheduling
    assert outs == synchronous
    finish = {c[2] for o in outs for c in o}
    assert finish == {"stop", "length"}             # both kinds of ending were exercised


def test_pipelined_with_preemption_equals_synchronous(synchronous):
    llm, outs = _run(True, block_size=16, num_kv_blocks=[10, 10], enable_prefix_caching=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert outs == synchronous


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_failure_seen_at_readback_fails_only_its_requests(tmp_path, async_scheduling):
    folder = write_checkpoint("north_like", tmp_path)
    llm = LLM(str(folder), device="cpu", dtype="float32", progress=False, block_size=4,
              async_scheduling=async_scheduling)

    class LateFailingBackend(DecodeBackend):
        """Launches fine; the third launch's completion check reports a hang (as the megakernel's watchdog)."""

        def __init__(self, model, cache):
            self.model, self.cache, self.calls = model, cache, 0

        def decode_async(self, batch, cache, trace=None):
            self.calls += 1
            n = self.calls

            def check():
                if n == 3:
                    raise MegakernelError("decode step hung: counter 9 stuck at 1 of 2")

            return self.model.forward(batch, cache), check

    eng = llm.engine
    eng.runner.decode_backend = LateFailingBackend(eng.model, eng.cache)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9, 10, 11]], params, use_tqdm=False)
    # token 1 from the prefill, tokens 2 and 3 from decode launches 1 and 2; launch 3 failed
    assert all(o.finish_reason == "abort" and "counter 9" in o.error for o in outs)
    assert [len(o.token_ids) for o in outs] == [3, 3]
    eng.drain()
    assert eng.num_kv_blocks_in_use() == 0
    eng.runner.decode_backend = TorchDecodeBackend(eng.model)
    again = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert again.finish_reason == "length" and again.token_ids[:3] == outs[0].token_ids


# ---- failures while pipelined: regressions found in review ------------------------------------------------------

class ScriptedBackend(DecodeBackend):
    """A decode backend on the PyTorch path whose n-th launch is refused (`refuse`) or reports a hang at read-back
    (`hang`); a hung launch also overwrites the K/V it wrote with garbage, as a kernel stopped midway may."""

    def __init__(self, engine, refuse=(), hang=()):
        self.eng, self.refuse, self.hang, self.calls = engine, set(refuse), set(hang), 0

    def decode_async(self, batch, cache, trace=None):
        self.calls += 1
        n = self.calls
        if n in self.refuse:
            raise MegakernelError(f"launch {n} refused")
        out = self.eng.model.forward(batch, cache)
        if n in self.hang:
            bs = cache.layout.block_size
            for i in range(self.eng.config.num_layers):
                g, layer_kv = cache.layer(i)
                for s, p in enumerate(batch.positions_list):
                    layer_kv[batch.block_tables[s][g][p // bs], :, p % bs] = 100.0

        def check():
            if n in self.hang:
                raise MegakernelError(f"launch {n} hung")

        return out, check


def _engine(folder, **kw):
    from megakernel import EngineArgs, LLMEngine

    kw = {"block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 8, **kw}
    return LLMEngine(EngineArgs(model=str(folder), device="cpu", dtype="float32", progress=False, **kw))


def _run_engine(eng, outs=None, max_steps=300):
    outs = {} if outs is None else outs
    for _ in range(max_steps):
        for o in eng.step():
            outs[o.request_id] = o
        if not eng.has_unfinished_requests():
            eng.drain()
            return outs
    raise AssertionError("requests never finished")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint("north_like", tmp_path_factory.mktemp("north_like_async"))


def test_kv_of_a_failed_step_is_not_kept_by_the_prefix_cache(tiny):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eng = _engine(tiny)
    eng.runner.decode_backend = ScriptedBackend(eng, hang={5})       # the decode at position 7 fails
    eng.add_request("a", [5, 6, 7], greedy)
    failed = _run_engine(eng)["a"]
    assert failed.finish_reason == "abort" and len(failed.outputs[0].token_ids) == 5
    eng.runner.decode_backend = TorchDecodeBackend(eng.model)
    follow_up = [5, 6, 7] + failed.outputs[0].token_ids + [1]         # e.g. the next turn of that chat
    eng.add_request("b", follow_up, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    again = _run_engine(eng)["b"]
    assert again.num_cached_tokens == 4                               # block 0 only; block 1 held position 7
    fresh = _engine(tiny, enable_prefix_caching=False)
    fresh.add_request("b", follow_up, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert again.outputs[0].token_ids == _run_engine(fresh)["b"].outputs[0].token_ids


def test_refused_launch_spares_prefills_when_its_decodes_stopped_late(tiny):
    eng = _engine(tiny)
    eng.add_request("solo", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    stop = _run_engine(eng)["solo"].outputs[0].token_ids[2]
    eng = _engine(tiny)
    eng.runner.decode_backend = ScriptedBackend(eng, refuse={3})
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop]))
    outs = {o.request_id: o for o in eng.step()}
    eng.add_request("b", list(range(20, 60)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = _run_engine(eng, outs)
    # a's stop token arrives with the read-back in the step whose launch is refused: a stopped, it did not fail
    assert outs["a"].outputs[0].finish_reason == "stop" and outs["a"].error is None
    assert outs["b"].outputs[0].finish_reason == "length" and outs["b"].error is None
    assert len(outs["b"].outputs[0].token_ids) == 3


def test_a_one_token_prefill_chunk_is_not_failed_with_the_decodes(tiny):
    eng = _engine(tiny)
    eng.runner.decode_backend = ScriptedBackend(eng, hang={3})
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    outs = {o.request_id: o for o in eng.step()}
    # 15 prompt tokens in chunks of 8 beside a's decode: 7 + 7 + a last chunk of 1, run in launch 3's step
    eng.add_request("b", list(range(20, 35)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = _run_engine(eng, outs)
    assert outs["a"].outputs[0].finish_reason == "abort" and "launch 3 hung" in outs["a"].error
    assert outs["b"].outputs[0].finish_reason == "length" and outs["b"].error is None
    assert eng.num_kv_blocks_in_use() == 0


def test_a_device_stuck_hang_fails_the_whole_step_without_reading_it(tiny):
    """When the kernel never ended (the host deadline, not the in-kernel watchdog), nothing queued behind it can
    be read back: every sequence sampled in that step fails, prefills included, and the engine goes on."""
    class StuckBackend(ScriptedBackend):
        def decode_async(self, batch, cache, trace=None):
            out, _ = super().decode_async(batch, cache, trace)

            def check():
                err = MegakernelError("decode megakernel did not finish within the host deadline")
                err.device_stuck = True
                raise err

            return out, check

    eng = _engine(tiny)
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    outs = {o.request_id: o for o in eng.step()}                 # a's prefill, read back in the next step
    eng.runner.decode_backend = StuckBackend(eng)
    eng.add_request("b", [8, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = _run_engine(eng, outs)          # a decodes on the stuck backend; b's prefill samples in that step
    assert outs["a"].outputs[0].finish_reason == "abort" and "host deadline" in outs["a"].error
    assert outs["b"].outputs[0].finish_reason == "abort" and outs["b"].outputs[0].token_ids == []
    assert eng.num_kv_blocks_in_use() == 0
    eng.runner.decode_backend = TorchDecodeBackend(eng.model)
    eng.add_request("c", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert _run_engine(eng)["c"].outputs[0].finish_reason == "length"


def test_an_unexpected_readback_error_ends_the_step_and_is_reported(tiny):
    """A non-megakernel error while reading a step back (a CUDA or tokenizer error) reaches the caller; the
    sequences of that step end with the error, the next step() reports them, and nothing is left waiting."""
    class Broken(ScriptedBackend):
        def decode_async(self, batch, cache, trace=None):
            out, _ = super().decode_async(batch, cache, trace)
            n = self.calls

            def check():
                if n == 2:
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")

            return out, check

    eng = _engine(tiny)
    eng.runner.decode_backend = Broken(eng)
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    outs, raised = {}, False
    for _ in range(20):
        try:
            for o in eng.step():
                outs[o.request_id] = o
        except RuntimeError as e:
            raised = "illegal memory access" in str(e)
        if not eng.has_unfinished_requests():
            break
    assert raised
    assert outs["a"].finished and outs["a"].outputs[0].finish_reason == "abort"
    assert "illegal memory access" in outs["a"].error
    assert -1 not in outs["a"].outputs[0].token_ids
    eng.drain()
    assert eng.num_kv_blocks_in_use() == 0
