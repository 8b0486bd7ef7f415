"""How many SMs do what, bin by bin, through one layer of a profiled step: the view that shows a second wave of
tiles or a phase where every SM computes on weights that already landed (HBM idle).

    python -m megakernel bench --random-north --backend megakernel --batch-size 1 --context 8192 --steps 10 \
        --trace tl_b1.npz
    python benchmarks/sm_states.py tl_b1.npz [--layer 20] [--bin-us 2] [--before-us 10] [--json out.json]

For each static task kind, `KIND:wait` counts the blocks between its claim and the end of its dependency wait and
`KIND:run` those from there to its end; `MOE_WORKER` counts the blocks inside a MoE worker task; `items KIND` the MoE
items in flight from claim to end (a paged worker holds several, so these may exceed the SMs). Each figure is the
bin's mean. Bins run from --before-us ahead of the layer's first router wait to the next layer's (the origin
layer_bandwidth.py uses, so the two line up). The b1 8K trace at 63e8d4d showed with it ~37 QKV tiles running 8-17 us
into the layer, after the first wave of ~123 (SPEED_NOTES, thirtieth session).
"""

from __future__ import annotations

import numpy as np

from megakernel.kernel import timeline as T


def sm_states(path: str, layer: int, bin_us: float = 2.0, before_us: float = 10.0) -> dict:
    tl = T.to_timeline(T.load_raw(path))
    ops = np.array([T.op_name(int(o)) for o in tl.tasks.op])
    t0, t1 = T.router_wait(tl, layer), T.router_wait(tl, layer + 1)
    dt = bin_us * 1e3
    edges = np.arange(t0 - before_us * 1e3, t1 + dt, dt)
    nb = len(edges) - 1
    series: dict[str, np.ndarray] = {}

    def add(name: str, a: np.ndarray, b: np.ndarray) -> None:
        ok = np.isfinite(a) & np.isfinite(b) & (b > a)
        if not ok.any():
            return
        series[name] = series.get(name, np.zeros(nb)) + T.bin_overlap(a[ok], b[ok], edges).sum(axis=0) / dt

    t = tl.tasks
    for name in np.unique(ops):
        m = ops == name
        if name == "MOE_WORKER":
            add(name, t.claim[m], t.end[m])
            continue
        waited = np.where(np.isfinite(t.waited[m]), t.waited[m], t.claim[m])
        add(f"{name}:wait", t.claim[m], waited)
        add(f"{name}:run", waited, t.end[m])
    it = tl.items
    iops = np.array([T.op_name(int(o)) for o in it.op])
    for name in np.unique(iops):
        m = iops == name
        add(f"items {name}", it.claim[m], it.end[m])
    order = sorted(series, key=lambda k: -series[k].sum())
    blocks = sum(v for k, v in series.items() if not k.startswith("items "))
    return {"trace": path, "layer": layer, "bin_us": bin_us, "layer_us": round((t1 - t0) / 1e3, 2),
            "blocks": int(len(tl.block_start)),
            "bins": [{"from_us": round((edges[j] - t0) / 1e3, 2), "busy_blocks": round(float(blocks[j]), 1),
                      **{k: round(float(series[k][j]), 1) for k in order if series[k][j] >= 0.05}}
                     for j in range(nb)],
            "columns": order}


def main() -> int:
    ap = T.trace_tool_parser(__doc__)
    ap.add_argument("--bin-us", type=float, default=2.0)
    ap.add_argument("--before-us", type=float, default=10.0)
    args = ap.parse_args()
    res = sm_states(args.npz, args.layer, args.bin_us, args.before_us)
    cols = [c for c in res["columns"] if any(c in b for b in res["bins"])]
    print(f"{res['trace']}: layer {res['layer']}, {res['layer_us']} us, {res['blocks']} blocks; "
          f"mean blocks (or items) per {res['bin_us']} us bin")
    print(f"{'us':>7} {'busy':>6} " + " ".join(f"{c[:16]:>16}" for c in cols))
    for b in res["bins"]:
        print(f"{b['from_us']:7.1f} {b['busy_blocks']:6.1f} " + " ".join(f"{b.get(c, 0.0):16.1f}" for c in cols))
    T.write_tool_json(res, args, __file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
