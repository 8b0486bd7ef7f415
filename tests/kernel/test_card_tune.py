"""benchmarks/card_tune.py's coordinate search on synthetic timings (the GPU run is the script's): it adopts a knob's
fastest candidate only past the gain and the noise bars, searches later knobs with earlier winners in place, and
proposes as the card's row only what differs from the plan's defaults."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from megakernel.kernel.plan import ModelPlan
from megakernel.kernel.tuning import TUNING_KEYS

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def ct():
    spec = importlib.util.spec_from_file_location("card_tune", BENCH / "card_tune.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["card_tune"] = mod          # (dataclasses resolve the module's annotations through sys.modules)
    spec.loader.exec_module(mod)
    return mod


def test_search_names_tuning_keys_with_their_defaults_among_the_values(ct):
    for ks in ct.SEARCH:
        assert ks.knob in TUNING_KEYS and ks.points and all(B >= 1 and ctx >= 1 for B, ctx in ks.points)
        assert getattr(ModelPlan, ks.knob) in ks.values, ks.knob     # the plan's default is always a candidate


def test_coordinate_search_adopts_winners_in_order(ct):
    """b's best value depends on a's: the search finds a's first, then b's given it; c's best candidate gains 0.3%,
    under the 0.5% bar, so c keeps its incumbent."""
    calls = []

    def measure(k, B, ctx):
        calls.append((dict(k), B, ctx))
        a = {1: 1.00, 2: 0.90, 3: 0.95}[k["a"]]
        b = 1.0 if k["b"] == 10 else (0.97 if k["a"] == 2 else 1.05)     # 20 pays only with a = 2
        c = 0.997 if k["c"] == 7 else 1.0
        return B * a * b * c

    search = (ct.KnobSearch("a", (1, 2, 3), ((1, 8),)), ct.KnobSearch("b", (10, 20), ((1, 8), (2, 8))),
              ct.KnobSearch("c", (5, 7), ((1, 8),)))
    chosen, records = ct.coordinate_search(search, measure, {"a": 1, "b": 10, "c": 5}, log=lambda s: None)
    assert chosen == {"a": 2, "b": 20, "c": 5}
    assert [r["chosen"] for r in records] == [2, 20, 5]
    assert all(k["a"] == 2 for k, _, _ in calls if "b" in k and k["b"] == 20)   # b searched with a's winner
    assert len(calls) == 4 + 3 * 2 + 3                 # per knob: the incumbent twice, each other candidate once
    assert ct.card_row(chosen, {"a": 1, "b": 10, "c": 5}) == {"a": 2, "b": 20}


def test_noise_raises_the_bar(ct):
    """The incumbent's two runs differ by 4%: a candidate 2% faster than its faster run is within that noise and not
    adopted; one 6% faster is."""
    runs = iter([1.00, 1.04])

    def measure_with(gain):
        def measure(k, B, ctx):
            return next(runs) if k["x"] == 0 else 1.00 * (1 - gain)
        return measure

    chosen, rec = ct.coordinate_search((ct.KnobSearch("x", (0, 1), ((1, 8),)),), measure_with(0.02), {"x": 0},
                                       log=lambda s: None)
    assert chosen == {"x": 0} and rec[0]["noise"] == pytest.approx(0.04)
    runs = iter([1.00, 1.04])
    chosen, _ = ct.coordinate_search((ct.KnobSearch("x", (0, 1), ((1, 8),)),), measure_with(0.06), {"x": 0},
                                     log=lambda s: None)
    assert chosen == {"x": 1}
