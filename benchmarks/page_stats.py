"""Where a paged MoE worker's items spend their time, from a profiled step's raw records (.npz).

    MEGAKERNEL_KERNEL_DEFINES=MK_PG_PAGE_STATS=1 python -m megakernel bench --random-north --backend megakernel \
        --batch-size 1 --context 8192 --steps 10 --trace ps_b1.npz
    python benchmarks/page_stats.py ps_b1.npz [--layer 20] [--json out.json]

Per item kind (gate/up, down, O), percentiles over the layer's items (and all layers') of the stamps' gaps: claim ->
first page issued -> inputs loaded -> first page's math -> last page's math -> epilogue written; and each worker's
rate (its items' bytes over its first issue to its last page's math). With the MK_PG_PAGE_STATS build an item's four
marks are sums over its pages (mk_pg_switches.cuh): its warps waiting for the page to land (starved), for the item's
inputs, their math, the loader waiting for the page's ring slot, and (builds from session 21's end on) the mean
flight, issue to landing, of the pages a warp was already waiting for, the loader's decode of the item before it
published it, and its time inside the pages' issue (session 34 on; before, those two were its waits for the item's
slot and for its claim's result). A ring whose warps starve while its loader never waits is short of bytes in flight
or of delivery, not of math (SPEED_NOTES, twenty-first session), or its loader is slow to issue (the issue time).
"""

from __future__ import annotations

import numpy as np

from megakernel.kernel import opcodes as O
from megakernel.kernel import timeline as T

KINDS = {O.PROF_ITEM_GU: "gate/up", O.PROF_ITEM_DN: "down", O.PROF_ITEM_O: "O"}
GAPS = (("claim", "issued"), ("issued", "waited"), ("issued", "landed"), ("landed", "computed"), ("computed", "end"))
PAGE_SUMS = ("starved", "inputs", "math", "loader blocked")
LOW = (1 << 32) - 1


def pct(a: np.ndarray) -> list[float]:
    return T.percentiles(a, 2)


def analyse(path: str, layer: int) -> dict:
    raw = T.load_raw(path)
    it = T.to_timeline(raw).items
    F = {k: i for i, k in enumerate(O.PROF_FIELDS)}
    packed = raw.items[:, [F[k] for k in O.PROF_MARK_FIELDS[:4]]].astype(np.int64)
    # the high 32 bits: m0 the loader's decode of the item, m1 the count of waited-for pages, m2 the loader's time
    # inside its pages' issue (after each ring slot's wait), m3 those pages' flights (mk_pg_switches.cuh PG_STATS;
    # traces before session 34 held the loader's item-slot and claim-result waits in m0 and m2's high halves)
    decode, n_waited, issue, flight = (packed[:, k] >> 32 for k in range(4))
    marks = (packed & LOW).astype(np.float64)
    # page sums are durations (a few to ~100 us); stamps would be ~step-sized absolute times
    has_sums = bool((packed >= 0).all() and len(marks) and marks.max() < 1e7 and (marks[:, 2] > 0).any())
    out: dict = {"trace": path, "layer": layer, "page_sums": has_sums, "kinds": {}}
    in_layer = it.layer == layer
    for op, name in KINDS.items():
        rec: dict = {}
        for scope, sel in (("layer", in_layer & (it.op == op)), ("all", it.op == op)):
            if not sel.any():
                continue
            r: dict = {"items": int(sel.sum()), "bytes": float(it.nbytes[sel][0])}
            for a, b in GAPS:
                r[f"{a}->{b} us"] = pct((getattr(it, b) - getattr(it, a))[sel] / 1e3)
            if has_sums:
                for k, nm in enumerate(PAGE_SUMS):
                    r[f"{nm} us (page sum)"] = pct(marks[sel, k] / 1e3)
                r["loader: decode before publish us"] = pct(decode[sel] / 1e3)
                r["loader: inside the pages' issue us (page sum)"] = pct(issue[sel] / 1e3)
                w = sel & (n_waited > 0)
                if w.any():
                    r["flight us per waited-for page"] = pct(flight[w] / n_waited[w] / 1e3)
                    r["waited-for pages per item"] = pct(n_waited[w].astype(np.float64))
            rec[scope] = r
        if rec:
            out["kinds"][name] = rec
    rates = []
    for b in np.unique(it.block[in_layer]):
        s = in_layer & (it.block == b)
        span = it.computed[s].max() - it.issued[s].min()
        if span > 0:
            rates.append(it.nbytes[s].sum() / span)
    out["workers"] = {"count": len(rates), "gb_per_s_p10_50_90": pct(np.array(rates))}
    return out


def main() -> int:
    args = T.trace_tool_parser(__doc__).parse_args()
    res = analyse(args.npz, args.layer)
    print(f"{res['trace']}: layer {res['layer']}, {res['workers']['count']} workers at "
          f"{res['workers']['gb_per_s_p10_50_90']} GB/s (p10/50/90)")
    for name, rec in res["kinds"].items():
        for scope, r in rec.items():
            print(f"  {name:8s} {scope:5s} {r['items']:6d} items of {r['bytes'] / 1024:.0f} KB")
            for k, v in r.items():
                if k not in ("items", "bytes"):
                    print(f"      {k:28s} {v}")
    T.write_tool_json(res, args, __file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
