"""Per-card tuning of the megakernel's plan: a coordinate search, in one process, over the knobs whose best value
measured card-dependent (kernel/tuning.py CARD_TUNING), printing the row to put in CARD_TUNING for this GPU.

    python benchmarks/card_tune.py --json OUT.json          # ~2-3 minutes; `--search moe_pages_tile_kb,dn_lag`

Knob by knob (SEARCH's order), at the knob's own points: the incumbent (the card's current value; the first knob
starts from the card's row, or the plan's default) runs twice, every other candidate once, each a geometric mean of
ms/step over the points. A candidate replaces the incumbent only if it beats the incumbent's faster run by more
than --min-gain and by more than the incumbent's two runs differ (their spread is the noise this machine shows);
later knobs are searched with the earlier winners in place. Session 31 did this by hand on an H200 (calls 4-15 of
benchmarks/results/speed_20261206s31): each row of CARD_TUNING is such a search's result, measured, not guessed.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class KnobSearch:
    knob: str                              # a kernel/tuning.py TUNING_KEYS key
    values: tuple[int, ...]                # candidates (the incumbent is added if missing)
    points: tuple[tuple[int, int], ...]    # (rows, context) where the knob acts


# The knobs that measured card-dependent in session 31 (H100 against H200), at the points where each acts.
SEARCH: tuple[KnobSearch, ...] = (
    KnobSearch("moe_pages_tile_kb_1row", (96, 128, 160), ((1, 8192), (1, 1024))),
    KnobSearch("moe_pages_tile_kb", (256, 384, 512, 1024), ((8, 8192), (16, 8192))),
    KnobSearch("o_workers_after_2row", (16, 32, 48), ((2, 8192), (2, 1024))),
    KnobSearch("wider_split_batch", (3, 4, 8, 16), ((3, 8192), (4, 8192), (8, 8192), (12, 8192))),
    KnobSearch("dn_lag", (16, 32, 64), ((8, 8192), (16, 8192))),
)

Measure = Callable[[dict[str, int], int, int], float]    # (knob overrides, rows, context) -> ms per step


def _gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def coordinate_search(search: tuple[KnobSearch, ...], measure: Measure, start: dict[str, int], min_gain: float = 0.005,
                      log: Callable[[str], None] = print) -> tuple[dict[str, int], list[dict]]:
    """The knobs' values after the search (start's, where nothing beat it) and one record per knob: every
    candidate's ms per point, the incumbent's two runs, the noise and the verdict."""
    chosen = dict(start)
    records = []
    for ks in search:
        inc = chosen[ks.knob]
        values = [inc] + [v for v in ks.values if v != inc]
        ms: dict[int, list[list[float]]] = {v: [] for v in values}
        for run in range(2):
            for v in values if run == 0 else [inc]:              # the incumbent twice: first and last
                ms[v].append([measure({**chosen, ks.knob: v}, B, ctx) for B, ctx in ks.points])
        inc_runs = [_gmean(r) for r in ms[inc]]
        best_inc, noise = min(inc_runs), abs(inc_runs[0] - inc_runs[1]) / min(inc_runs)
        cands = {v: _gmean(ms[v][0]) for v in values if v != inc}
        winner = min(cands, key=lambda v: (cands[v], v)) if cands else inc
        bar = best_inc * (1 - max(min_gain, noise))
        adopt = bool(cands) and cands[winner] < bar
        if adopt:
            chosen[ks.knob] = winner
        records.append(dict(knob=ks.knob, points=[list(p) for p in ks.points], incumbent=inc,
                            incumbent_ms=[list(r) for r in ms[inc]], candidates_ms={str(v): ms[v][0] for v in cands},
                            noise=noise, bar_gmean_ms=bar, chosen=chosen[ks.knob]))
        log(f"{ks.knob}: incumbent {inc} ({' / '.join(f'{x:.3f}' for x in inc_runs)} ms, spread {100 * noise:.2f}%); "
            + ", ".join(f"{v}: {cands[v]:.3f}" for v in cands)
            + f" -> {chosen[ks.knob]}" + ("" if adopt else " (kept)"))
    return chosen, records


def card_row(chosen: dict[str, int], plan_defaults: dict[str, int]) -> dict[str, int]:
    """What CARD_TUNING should hold for this card: the searched knobs whose value differs from the plan's default."""
    return {k: v for k, v in chosen.items() if plan_defaults.get(k) != v}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--search", default="", help="comma-separated knobs of SEARCH to run (default: all, in order)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--min-gain", type=float, default=0.005, help="the least fraction a candidate must gain")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = [n for n in args.search.split(",") if n]
    bad = set(names) - {ks.knob for ks in SEARCH}
    if bad:
        raise SystemExit(f"--search: not in SEARCH: {sorted(bad)} (known: {', '.join(ks.knob for ks in SEARCH)})")
    search = tuple(ks for ks in SEARCH if not names or ks.knob in names)

    import torch

    from megakernel.bench import _run_point, run_record
    from megakernel.kernel.plan import ModelPlan
    from megakernel_variants import north_engine, plan_knobs

    engine = north_engine(max(c for ks in search for _, c in ks.points), args.steps)
    be = engine.runner.decode_backend
    base = plan_knobs(be)
    n = 0

    def measure(knobs: dict[str, int], B: int, ctx: int) -> float:
        nonlocal n
        be.set_tuning(**{**base, **knobs})
        n += 1
        return _run_point(engine, engine.config, B, ctx, args.steps, "synthetic", None, f"t{n}-{B}-{ctx}").ms_per_step

    t0 = time.perf_counter()
    name = torch.cuda.get_device_name()
    print(f"{name}: card row {be.card_tuning or '{}'}; searching {', '.join(ks.knob for ks in search)}", flush=True)
    chosen, records = coordinate_search(search, measure, {ks.knob: base[ks.knob] for ks in search}, args.min_gain,
                                        log=lambda s: print(s, flush=True))
    row = card_row(chosen, {ks.knob: getattr(ModelPlan, ks.knob) for ks in search})
    print(f"CARD_TUNING row for this card ({time.perf_counter() - t0:.0f} s): ({name!r}, {row}),", flush=True)
    if args.json:
        doc = dict(**run_record(), search=[asdict(ks) for ks in search], steps=args.steps, min_gain=args.min_gain,
                   records=records, chosen=chosen, card_row=row)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
