"""Where a decode attention split's time goes, from a profiled step's raw records (.npz) of the MK_ATTN_STATS build.

    MEGAKERNEL_KERNEL_DEFINES=MK_ATTN_STATS=1 python -m megakernel bench --random-north --backend megakernel \
        --batch-size 1 --context 8192 --steps 10 --trace as_b1.npz
    python benchmarks/attn_stats.py as_b1.npz [--layer 20] [--json out.json]

Per split (ATTN task), from its four marks (mk_common.cuh MK_ATTN_STATS: sums over its chunks, in ns): thread 0's
wait for each chunk's copies, the chunks' math, issuing the next chunks, and the chunk count; with the split's K/V
bytes and its span (dependency met -> end), per chunk: wait, math and issue, and the split's GB/s. Percentiles
(p10 / p50 / p90) over the layer's splits and over all layers'. attn_stream.cu timed the copies alone at ~2.0 us per
64 KB chunk and the math at ~0.4, where the step's chunks take ~4.5 (SPEED_NOTES, twentieth session): a split whose
chunks mostly wait is bound by delivery under the step's load, one whose math grew by something inside the SM.
Under MK_ATTN_ISSUE=1 "issue" is thread 0's own share (none of the copies in the one-warp variant, b3+, whose idle
warps issue them: there a slow issue shows as math) and "wait" its own wait (mk_common.cuh says so).
"""

from __future__ import annotations

import numpy as np

from megakernel.kernel import opcodes as O
from megakernel.kernel import timeline as T

SUMS = ("wait", "math", "issue")


def pct(a: np.ndarray) -> list[float]:
    return T.percentiles(a, 3)


def analyse(path: str, layer: int) -> dict:
    raw = T.load_raw(path)
    ev = T.to_timeline(raw).tasks
    F = {k: i for i, k in enumerate(O.PROF_FIELDS)}
    marks = raw.tasks[:, [F[k] for k in O.PROF_MARK_FIELDS[:4]]].astype(np.int64)
    attn = (ev.op == int(O.Op.ATTN)) & (ev.end > ev.waited)
    chunks = marks[:, 3]
    # sums are durations (up to ~1 ms) and a chunk count; stamps would be step-sized absolute times, -1 untaken
    stats = bool(attn.any() and (marks[attn] >= 0).all() and (chunks[attn] > 0).all()
                 and chunks[attn].max() < 1 << 20 and marks[attn, :3].max() < 10**9)
    out: dict = {"trace": path, "layer": layer, "chunk_sums": stats, "scopes": {}}
    for scope, sel in (("layer", attn & (ev.layer == layer)), ("all", attn)):
        if not sel.any():
            continue
        span = ev.end[sel] - ev.waited[sel]
        r: dict = {"splits": int(sel.sum()), "kb_p10_50_90": pct(ev.nbytes[sel] / 1024),
                   "span us": pct(span / 1e3), "gb_per_s": pct(ev.nbytes[sel] / span)}
        if stats:
            n = chunks[sel].astype(np.float64)
            r["chunks"] = pct(n)
            for k, name in enumerate(SUMS):
                r[f"{name} us per chunk"] = pct(marks[sel, k] / n / 1e3)
            r["wait share of the span"] = pct(marks[sel, 0] / span)
        out["scopes"][scope] = r
    return out


def main() -> int:
    args = T.trace_tool_parser(__doc__).parse_args()
    res = analyse(args.npz, args.layer)
    print(f"{res['trace']}: layer {res['layer']}, chunk sums {'present' if res['chunk_sums'] else 'absent'}")
    for scope, r in res["scopes"].items():
        print(f"  {scope:5s} {r['splits']} splits")
        for k, v in r.items():
            if k != "splits":
                print(f"      {k:26s} {v}")
    T.write_tool_json(res, args, __file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
