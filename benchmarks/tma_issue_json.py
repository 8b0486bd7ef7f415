"""benchmarks/tma_issue.cu's printed tables as the results JSON (commit, date, GPU, command, every figure), so a device
call's text output becomes `benchmarks/results/...` records without hand copying.

    python benchmarks/tma_issue_json.py tma_issue.txt --commit SHA --command "..." [--date ISO] > tma_issue.json

Reads both modes: the full run (bursts, then the ring with its warm-up variants) and `tma_issue layouts` (the ring
per address layout, order and item size). Records:
- bursts: {sms, copy_kb, n, mode, burst_us, gb_per_s_per_sm};
- rings:  {sms, page_kb, slots, config, gb_per_s_per_sm}; a layouts line's order (in-order / any-order) is part of
  its config, e.g. "scattered8 in-order".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime, timezone

_BURST = re.compile(r"^sms\s+(\d+)\s+(\d+) KB x\s+(\d+):(.*)$")
_RING = re.compile(r"^sms\s+(\d+)\s+(\d+) KB ring of\s+(\d+)\s*(in-order|any-order)?\s*:(.*)$")
_BURST_CELL = re.compile(r"(\w+)\s+([\d.]+) us\s+([\d.]+)")


def _ring_cells(text: str) -> list[tuple[str, float]]:
    """'contiguous in-order  23.3  scattered any-order  19.8' -> [(label, rate), ...]: each label the words before
    its number."""
    cells, words = [], []
    for tok in text.split():
        try:
            rate = float(tok)
        except ValueError:
            words.append(tok)
            continue
        if not words:
            raise ValueError(f"a rate without a label in {text!r}")
        cells.append((" ".join(words), rate))
        words = []
    if words:
        raise ValueError(f"a label without a rate in {text!r}")
    return cells


def parse(text: str) -> dict:
    """The records of one tma_issue output (any mode). Raises ValueError on a line it cannot read."""
    gpu, notes, bursts, rings = None, [], [], []
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            continue
        if line.startswith("#"):
            note = line.lstrip("# ").strip()
            notes.append(note)
            if gpu is None and not note.startswith(("ring", "layouts", "tensor map")):
                gpu = note.split(";")[0].strip()
            continue
        if m := _BURST.match(line):
            sms, kb, n = map(int, m.group(1, 2, 3))
            cells = _BURST_CELL.findall(m.group(4))
            if not cells:
                raise ValueError(f"no burst cells in {line!r}")
            bursts += [{"sms": sms, "copy_kb": kb, "n": n, "mode": mode, "burst_us": float(us),
                        "gb_per_s_per_sm": float(rate)} for mode, us, rate in cells]
            continue
        if m := _RING.match(line):
            sms, kb, slots = map(int, m.group(1, 2, 3))
            order = m.group(4)
            for label, rate in _ring_cells(m.group(5)):
                rings.append({"sms": sms, "page_kb": kb, "slots": slots,
                              "config": f"{label} {order}" if order else label, "gb_per_s_per_sm": rate})
            continue
        raise ValueError(f"unrecognised line: {line!r}")
    return {"gpu": gpu, "notes": notes, "bursts": bursts, "rings": rings}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("text", help="tma_issue's printed output")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--command", required=True, help="the exact command that produced the text")
    ap.add_argument("--date", default=None, help="ISO date of the run (default: now)")
    args = ap.parse_args(argv)
    with open(args.text) as f:
        rec = parse(f.read())
    out = {"commit": args.commit, "date": args.date or datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "gpu": rec["gpu"], "command": args.command, "notes": rec["notes"]}
    out.update({k: rec[k] for k in ("bursts", "rings") if rec[k]})
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
