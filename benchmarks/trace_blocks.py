"""What every block did during one layer of a profiled step: one line per block, its tasks and MoE items in order,
each as KIND claim/waited/end (us after the layer's start), so idle SMs and late starts show at a glance.

    python benchmarks/trace_blocks.py tl_b1.npz [--layer 24]

The npz is what `megakernel bench --trace X.npz` writes (timeline.save_raw). A layer starts where its first QKV /
router tile stops waiting (fused norm) or its NORM ends, as timeline.layer_events anchors it; the window runs to the
next layer's start.
"""

from __future__ import annotations

import argparse

import numpy as np

from megakernel.kernel import opcodes as O
from megakernel.kernel import timeline as T

SHORT = {"QKV": "qkv", "ROUTER": "rt", "TOPK": "TOPK", "ATTN": "ATT", "ATTN_COMBINE": "cmb", "OPROJ": "o",
         "MOE_WORKER": "W", "MOE_GATE_UP": "gu", "MOE_DOWN": "dn", "OPROJ_ITEM": "oi", "NORM": "nrm",
         "LM_HEAD": "lm", "MLP_GU": "mgu", "MLP_DOWN": "mdn", "ARGMAX": "amx"}


def layer_start(tl: T.Timeline, l: int) -> float:
    t = tl.tasks
    m = (t.layer == l) & ((t.op == O.Op.QKV) | (t.op == O.Op.ROUTER))
    n = (t.layer == l) & (t.op == O.Op.NORM)
    return float(t.end[n].max()) if n.any() else float(t.waited[m].min())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("npz")
    ap.add_argument("--layer", type=int, default=24)
    args = ap.parse_args()
    tl = T.to_timeline(T.load_raw(args.npz))
    l = args.layer
    t0, t1 = layer_start(tl, l), layer_start(tl, l + 1)
    print(f"layer {l}: {t0 / 1e3:.1f} .. {t1 / 1e3:.1f} us into the step ({(t1 - t0) / 1e3:.1f} us)")
    rows: dict[int, list[tuple[float, str]]] = {}
    busy = np.zeros(tl.n_blocks)
    for ev, is_item in ((tl.tasks, False), (tl.items, True)):
        sel = (ev.end > t0) & (ev.claim < t1)
        for i in np.flatnonzero(sel):
            name = SHORT.get(T.op_name(int(ev.op[i])), T.op_name(int(ev.op[i])))
            lay = int(ev.layer[i])
            tag = name if lay == l else f"{name}@{lay}"
            c, w, e = ((ev.claim[i] - t0) / 1e3, (ev.waited[i] - t0) / 1e3, (ev.end[i] - t0) / 1e3)
            txt = f"{tag} {c:.1f}/{w:.1f}/{e:.1f}" if not is_item else f"[{tag} {w:.1f}-{e:.1f}]"
            rows.setdefault(int(ev.block[i]), []).append((float(ev.claim[i]) + (0.5 if is_item else 0), txt))
            if not (T.op_name(int(ev.op[i])) == "MOE_WORKER"):
                lo, hi = max(ev.waited[i], t0), min(ev.end[i], t1)
                busy[int(ev.block[i])] += max(0.0, hi - lo)
    for b in range(tl.n_blocks):
        items = sorted(rows.get(b, []))
        print(f"b{b:3d} busy {busy[b] / (t1 - t0) * 100:3.0f}%: " + "  ".join(x for _, x in items))


if __name__ == "__main__":
    main()
