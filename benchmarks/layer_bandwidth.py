"""HBM read rate over one layer of a profiled step, from its raw records (.npz): where in the layer the bytes move.

    python -m megakernel bench --random-north --backend megakernel --batch-size 1 --context 8192 --steps 10 \
        --trace tl_b1.npz
    python benchmarks/layer_bandwidth.py tl_b1.npz [--layer 20] [--bin-us 2]

Each task or MoE item's bytes (weights, K/V) are spread evenly over its span from its first copy issued to its math
done, and summed per time bin from the layer's first router wait to the next layer's. An approximation (a tile's
bytes land in a burst after its issue, not evenly), but bins of a few us show the layer's phases: in the b1 8K step
at 7c8d10c the routing window (8-14 us into the layer) moves 0.3-0.8 TB/s, the MoE phase 2-3.9 TB/s
(SPEED_NOTES, twenty-first session).
"""

from __future__ import annotations

import numpy as np

from megakernel.kernel import timeline as T


def layer_profile(path: str, layer: int, bin_us: float = 2.0) -> dict:
    tl = T.to_timeline(T.load_raw(path))
    spans = []
    for ev in (tl.tasks, tl.items):
        ok = (ev.nbytes > 0) & np.isfinite(ev.issued) & np.isfinite(ev.computed) & (ev.computed > ev.issued)
        spans.append(np.stack([ev.issued[ok], ev.computed[ok], ev.nbytes[ok]], axis=1))
    a, b, n = np.concatenate(spans).T
    t0, t1 = T.router_wait(tl, layer), T.router_wait(tl, layer + 1)
    dt = bin_us * 1e3
    edges = np.arange(t0, t1 + dt, dt)
    rate = n / (b - a)                                   # bytes per ns
    # overlap of each span with each bin, summed: bytes per bin
    per_bin = (T.bin_overlap(a, b, edges) * rate[:, None]).sum(axis=0)
    gbs = per_bin / dt                                   # bytes per ns = GB/s
    return {"trace": path, "layer": layer, "layer_us": round((t1 - t0) / 1e3, 2), "bin_us": bin_us,
            "layer_gb_per_s": round(float(per_bin.sum() / (t1 - t0)), 1),
            "bins": [{"from_us": round(i * bin_us, 2), "gb_per_s": round(float(g), 1)} for i, g in enumerate(gbs)]}


def main() -> int:
    ap = T.trace_tool_parser(__doc__)
    ap.add_argument("--bin-us", type=float, default=2.0)
    args = ap.parse_args()
    res = layer_profile(args.npz, args.layer, args.bin_us)
    print(f"{res['trace']}: layer {res['layer']}, {res['layer_us']} us, {res['layer_gb_per_s']} GB/s on average")
    for b in res["bins"]:
        print(f"  {b['from_us']:6.1f} us  {b['gb_per_s']:7.0f} GB/s  " + "#" * int(b["gb_per_s"] / 100))
    T.write_tool_json(res, args, __file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
