"""Which instructions wait for a long-latency result, from a build's SASS: the CPU check that found the paged
loader stalling on its claim (SPEED_NOTES, twenty-third session).

    python benchmarks/sass_waits.py LIB.so|DUMP.txt [--op 'ATOM\\.E\\.ADD'] [--range fb000:fe000] [--after 3]

On sm_90 every instruction's control bits (the high word's bits 41-61, as cuobjdump prints it) hold its stall
count, the scoreboard its result sets (write barrier, 7 = none) and the mask of scoreboards it waits on. For each
instruction matching --op that sets a scoreboard, this prints the instructions just before it that wait on that
scoreboard (in a loop, the previous lap's result: what made the claim inside the page loop stall the next page) and
the first --after ones after it (the first is where the result is really waited for). Whether the overlap the
source intends survives compilation is then a matter of reading addresses, not of a device run. A move or select of
a result waits like a use (session 22's claim-ahead), and results on one scoreboard are waited for together.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]+) \*/")
_HI = re.compile(r"^\s*/\* (0x[0-9a-f]+) \*/\s*$")


@dataclass
class Instr:
    addr: int
    text: str
    stall: int
    write_bar: int      # the scoreboard its result sets (7: none)
    read_bar: int
    wait_mask: int      # bit k: waits on scoreboard k

    def waits_on(self, bar: int) -> bool:
        return bar < 6 and bool(self.wait_mask >> bar & 1)


def parse(sass: str) -> list[Instr]:
    """cuobjdump -sass text: each instruction's line, then its control word's line."""
    lines = sass.splitlines()
    out = []
    for i, line in enumerate(lines[:-1]):
        m = _LINE.search(line)
        h = _HI.match(lines[i + 1]) if m else None
        if m and h:
            c = int(h.group(1), 16) >> 41
            out.append(Instr(int(m.group(1), 16), m.group(2), c & 0xF, (c >> 5) & 7, (c >> 8) & 7, (c >> 11) & 0x3F))
    return out


def waiters(instrs: list[Instr], op: str, lo: int = 0, hi: int = 1 << 48, before: int = 4,
            after: int = 3) -> list[dict]:
    """Per instruction matching `op` in [lo, hi] that sets a scoreboard: the waits on it just before and after."""
    res = []
    rx = re.compile(op)
    for k, ins in enumerate(instrs):
        if not (lo <= ins.addr <= hi and rx.search(ins.text) and ins.write_bar < 6):
            continue
        b = ins.write_bar
        res.append({"addr": ins.addr, "text": ins.text, "bar": b,
                    "before": [(x.addr, x.text) for x in instrs[max(0, k - before):k] if x.waits_on(b)],
                    "after": [(x.addr, x.text) for x in instrs[k + 1:] if x.waits_on(b)][:after]})
    return res


def cuobjdump() -> str | None:
    """cuobjdump from $CUOBJDUMP, PATH, the CUDA toolkit beside nvcc, or the copy Triton ships."""
    cands = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(str(Path(nvcc).resolve().parent / "cuobjdump"))
    try:
        import triton
        cands.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"))
    except ImportError:
        pass
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a built library (.so / cubin) or a saved `cuobjdump -sass` dump")
    ap.add_argument("--op", default=r"ATOM\.E\.ADD|ATOMG\.E\.ADD")
    ap.add_argument("--range", default=None, help="LO:HI addresses in hex")
    ap.add_argument("--after", type=int, default=3)
    args = ap.parse_args()
    if Path(args.path).read_bytes()[:4] != b"\x7fELF":     # a saved dump, whatever its name
        text = Path(args.path).read_text()
    else:
        tool = cuobjdump()
        if tool is None:
            raise SystemExit("cuobjdump not found (set $CUOBJDUMP)")
        text = subprocess.run([tool, "-sass", args.path], capture_output=True, text=True, check=True).stdout
    lo, hi = (int(x, 16) for x in args.range.split(":")) if args.range else (0, 1 << 48)
    for r in waiters(parse(text), args.op, lo, hi, after=args.after):
        print(f"{r['addr']:x} {r['text']}  (scoreboard {r['bar']})")
        for a, t in r["before"]:
            print(f"    waited for just before it (a loop's previous lap): {a:x} {t}")
        for a, t in r["after"]:
            print(f"    waited for at +{a - r['addr']:#x}: {a:x} {t}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
