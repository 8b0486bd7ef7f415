"""Plots of `megakernel bench` results: tokens/s and % of the memory roofline, over context (batch 1) and over
batch size (8K context), one line per backend. `python -m megakernel.bench_plot RESULTS.json OUT.png`."""

from __future__ import annotations

import json
import sys


def plot_decode(doc: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = doc["points"]
    backends = sorted({p["backend"] for p in pts}, key=["megakernel", "graph", "torch"].index)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    views = [("context", lambda p: p["batch_size"] == 1, "context (tokens), batch 1"),
             ("batch_size", lambda p: p["context"] == 8192, "batch size, 8K context")]
    for col, (key, keep, label) in enumerate(views):
        for be in backends:
            sel = sorted((p for p in pts if p["backend"] == be and keep(p)), key=lambda p: p[key])
            if not sel:
                continue
            xs = [p[key] for p in sel]
            axes[0][col].plot(xs, [p["tokens_per_s"] for p in sel], marker="o", label=be)
            if sel[0]["roofline_pct"] is not None:
                axes[1][col].plot(xs, [p["roofline_pct"] for p in sel], marker="o", label=be)
        for row, ylabel in enumerate(("tokens / s", "% of measured memory roofline")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel(label)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend()
    axes[0][0].set_yscale("log")
    axes[0][1].set_yscale("log")
    peak = doc.get("peak_read_gb_per_s")
    fig.suptitle(f"decode through the engine on {doc.get('gpu', '?')} (commit {doc.get('commit', '?')}, "
                 f"peak read {peak:.0f} GB/s, KV fill {doc.get('kv_fill', '?')})" if peak else "decode")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    plot_decode(json.loads(open(sys.argv[1]).read()), sys.argv[2])
