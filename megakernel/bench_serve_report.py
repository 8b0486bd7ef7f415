"""Tables and plots of `megakernel bench serve` results, and merging several result files (one per device call).

`python -m megakernel.bench_serve_report A.json [B.json ...] [--json ALL.json] [--plot ALL.png] [--markdown ALL.md]`
prints the markdown table of the (merged) records.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

BACKEND_ORDER = ["megakernel", "graph", "torch"]


def _order(backend: str) -> int:
    return BACKEND_ORDER.index(backend) if backend in BACKEND_ORDER else len(BACKEND_ORDER)


def sorted_records(doc: dict) -> list[dict]:
    """Records by workload (in the order they were run), concurrency, then backend."""
    seen: list[str] = []
    for r in doc["records"]:
        if r["workload"] not in seen:
            seen.append(r["workload"])
    return sorted(doc["records"], key=lambda r: (seen.index(r["workload"]), r["concurrency"], _order(r["backend"])))


def _f(v: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, fmt)


def markdown_table(doc: dict) -> str:
    """The results table (one row per run) and the issue's targets where the records hold them."""
    lines = [f"Commit {doc.get('commit', '?')}, {doc.get('gpu', '?')}, {doc.get('date', '?')}: "
             f"`{doc.get('command', '?')}`", "",
             "| workload | concurrency | backend | requests/s | output tok/s | prompt tok/s | TTFT p50 / p99 (s) | "
             "ITL p50 / p99 (ms) | E2E p50 (s) | done / cut / failed | engine idle |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted_records(doc):
        idle = _f(r.get("gpu_idle_share"), ".1f", 100.0)
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {r['backend']} | {r['requests_per_s']:.2f} | "
            f"{r['output_tokens_per_s']:.1f} | {r['prompt_tokens_per_s']:.0f} | "
            f"{_f(r['ttft_p50_s'], '.2f')} / {_f(r['ttft_p99_s'], '.2f')} | "
            f"{_f(r['itl_p50_s'], '.1f', 1e3)} / {_f(r['itl_p99_s'], '.1f', 1e3)} | {_f(r['e2e_p50_s'], '.1f')} | "
            f"{r['requests_completed']} / {r['requests_incomplete']} / {r['requests_failed']} | "
            f"{idle}{'%' if idle != '-' else ''} |")
    targets = target_lines(doc)
    if targets:
        lines += ["", *targets]
    lines += ["", "Engine idle: the engine idle share (device time between one step's work and the next step's "
              "launch, while requests were in the engine). Cut: still running at the run's time limit."]
    return "\n".join(lines)


def target_lines(doc: dict) -> list[str]:
    """Issue 13's H200 targets, judged on the records (where both backends ran the workload at concurrency 8)."""
    by = {(r["backend"], r["workload"], r["concurrency"]): r for r in doc["records"]}
    out = []
    mk, gr = by.get(("megakernel", "fixed", 8)), by.get(("graph", "fixed", 8))
    if mk and gr and gr["output_tokens_per_s"] > 0:
        ratio = mk["output_tokens_per_s"] / gr["output_tokens_per_s"]
        itl = mk["itl_p99_s"] / mk["itl_p50_s"] if mk["itl_p50_s"] and mk["itl_p99_s"] is not None else None
        ok = ratio >= 1.4 and itl is not None and itl <= 2
        out.append(f"- fixed, concurrency 8: megakernel / graph output tok/s {ratio:.2f}x (target >= 1.4x), "
                   f"megakernel ITL p99 / p50 {_f(itl, '.2f')} (target <= 2): {'met' if ok else 'missed'}")
    mk, gr = by.get(("megakernel", "code-mix", 8)), by.get(("graph", "code-mix", 8))
    if mk and gr:
        tok = mk["output_tokens_per_s"] > gr["output_tokens_per_s"]
        ttft = None not in (mk["ttft_p50_s"], gr["ttft_p50_s"]) and mk["ttft_p50_s"] < gr["ttft_p50_s"]
        out.append(f"- code-mix, concurrency 8: output tok/s megakernel {mk['output_tokens_per_s']:.1f} vs graph "
                   f"{gr['output_tokens_per_s']:.1f}, TTFT p50 {_f(mk['ttft_p50_s'], '.2f')} vs "
                   f"{_f(gr['ttft_p50_s'], '.2f')} s (target: megakernel ahead on both): "
                   f"{'met' if tok and ttft else 'missed'}")
    return out


def plot_serve(doc: dict, out: str) -> None:
    """One row per workload: output tok/s, TTFT (p50 solid, p99 dashed) and ITL (p50, p99) over concurrency, one
    colour per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    recs = sorted_records(doc)
    workloads = list(dict.fromkeys(r["workload"] for r in recs))
    backends = sorted({r["backend"] for r in recs}, key=_order)
    colours = {b: f"C{i}" for i, b in enumerate(backends)}
    fig, axes = plt.subplots(len(workloads), 3, figsize=(13, 3.4 * len(workloads)), squeeze=False)
    panels = [("output tokens / s", [("output_tokens_per_s", "-", 1.0)]),
              ("TTFT (s): p50 solid, p99 dashed", [("ttft_p50_s", "-", 1.0), ("ttft_p99_s", "--", 1.0)]),
              ("inter-token latency (ms): p50, p99", [("itl_p50_s", "-", 1e3), ("itl_p99_s", "--", 1e3)])]
    for row, w in enumerate(workloads):
        for col, (ylabel, series) in enumerate(panels):
            ax = axes[row][col]
            for b in backends:
                sel = [r for r in recs if r["workload"] == w and r["backend"] == b]
                for key, style, scale in series:
                    pts = [(r["concurrency"], r[key] * scale) for r in sel if r.get(key) is not None]
                    if pts:
                        ax.plot(*zip(*pts), style, marker="o", color=colours[b],
                                label=b if style == "-" else None)
            concs = sorted({r["concurrency"] for r in recs})
            ax.set_xscale("log", base=2)
            ax.set_xticks(concs, [str(c) for c in concs])
            ax.set_xlabel("concurrency")
            ax.set_ylabel(ylabel)
            if col == 0:
                ax.set_title(f"{w}: {doc.get('workloads', {}).get(w, {}).get('lengths', '')}", fontsize=8,
                             loc="left")
            ax.grid(True, alpha=0.3)
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            if row == 0 and col == 0:
                ax.legend()
    fig.suptitle(f"megakernel bench serve on {doc.get('gpu', '?')} (commit {doc.get('commit', '?')})")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def merge(docs: list[dict]) -> dict:
    """One document from several runs (e.g. one device call per backend): the first's header, every record."""
    if not docs:
        raise ValueError("nothing to merge")
    out: dict[str, Any] = {k: v for k, v in docs[0].items() if k != "records"}
    if len(docs) > 1:
        out["command"] = " ; ".join(d.get("command", "?") for d in docs)
        out["commit"] = ",".join(dict.fromkeys(str(d.get("commit")) for d in docs))
        out["workloads"] = {k: v for d in docs for k, v in d.get("workloads", {}).items()}
    out["records"] = [r for d in docs for r in d["records"]]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megakernel.bench_serve_report", description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", help="bench serve JSON files")
    p.add_argument("--json", default=None, help="write the merged document here")
    p.add_argument("--plot", default=None, help="draw it to this PNG")
    p.add_argument("--markdown", default=None, help="write the table here")
    args = p.parse_args(argv)
    doc = merge([json.loads(Path(f).read_text()) for f in args.inputs])
    table = markdown_table(doc)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        plot_serve(doc, args.plot)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
