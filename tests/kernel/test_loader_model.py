"""benchmarks/loader_model.py (CPU): the paged worker's discrete-event model obeys the bounds its protocol implies,
so a prediction written from it is at least self-consistent."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path


def _model():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "loader_model.py"
    spec = importlib.util.spec_from_file_location("loader_model", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["loader_model"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_a_loader_bound_worker_streams_one_page_per_issue_cost():
    m = _model()
    # a loader that pays 1 us per page and nothing else is the bound: 16 KB per us (the ring, math and flight keep up)
    c = replace(m.Costs(), decode=0.0, publish=0.0, issue=1.0, epilogue=0.0, claim_rt=0.0)
    assert abs(m.rate_gb_per_s(c) - 16384 / 1e3) < 0.05


def test_a_ring_bound_worker_streams_the_ring_per_page_cycle():
    m = _model()
    # a free loader: each ring page cycles in flight + math, so npg pages per cycle
    c = replace(m.Costs(), decode=0.0, publish=0.0, issue=0.0, epilogue=0.0, claim_rt=0.0, flight=2.0, math=2.0)
    assert abs(m.rate_gb_per_s(c) - 12 * 16384 / 4.0 / 1e3) < 0.5


def test_costlier_steps_never_stream_faster():
    m = _model()
    base = m.Costs()
    r0 = m.rate_gb_per_s(base)
    for name, more in (("issue", 0.3), ("decode", 1.0), ("publish", 0.5), ("claim_rt", 3.0), ("math", 3.0)):
        assert m.rate_gb_per_s(replace(base, **{name: getattr(base, name) + more})) <= r0 + 1e-9, name
    assert m.rate_gb_per_s(replace(base, decode_early=False)) <= r0 + 1e-9
    # where the item slots bind (one slot: the next item waits for this one's epilogue), the decode before the
    # slot's wait (MK_PG_DECODE_EARLY) overlaps it
    slow = replace(base, slots=1)
    assert m.rate_gb_per_s(replace(slow, decode_early=False)) < m.rate_gb_per_s(slow) - 0.5
    # and the decode itself is on the loader's path (after the claim's result): pg_stream's "no decode" streams faster
    assert m.rate_gb_per_s(replace(base, decode=0.0)) > r0 + 0.5
