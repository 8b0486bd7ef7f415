"""The engine idle share's CUDA-event path (megakernel/server/step_gaps.py) on a GPU: busy and gap seconds tile the
device time of a busy stretch, and the wait for the next request is not counted (run through the device tool)."""

from __future__ import annotations

import time

import pytest
import torch

from megakernel import SamplingParams
from megakernel.engine.llm_engine import EngineArgs, LLMEngine
from megakernel.server.step_gaps import watch_step_gaps

pytestmark = pytest.mark.gpu


def test_step_gaps_tile_a_busy_stretch_on_cuda():
    engine = LLMEngine(EngineArgs(device="cuda", backend="torch", max_num_seqs=4, kv_cache_memory=256 << 20,
                                  progress=False))
    meter = watch_step_gaps(engine)
    assert meter is not None and meter._mark().__class__.__name__ == "_CudaMark"
    g = torch.Generator().manual_seed(0)

    def run(n: int, sleep_between: float = 0.0) -> float:
        for i in range(n):
            engine.add_request(f"r{time.monotonic()}-{i}", torch.randint(16, 2000, (64,), generator=g).tolist(),
                               SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            time.sleep(sleep_between)        # the host late between steps: the device has nothing queued
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    wall = run(4)
    a = meter.totals()
    assert a["steps"] >= 24 and a["busy_s"] > 0
    assert abs(a["busy_s"] + a["gap_s"] - wall) < 0.25 * wall       # device time of the stretch ~ its wall time
    time.sleep(0.5)                                                   # idle: not counted
    run(2, sleep_between=0.01)
    b = meter.totals()
    steps = b["steps"] - a["steps"]
    gap = b["gap_s"] - a["gap_s"]
    assert 0.5 * 0.01 * (steps - 1) < gap < 0.01 * steps + 0.2        # ~10 ms of nothing queued per step
