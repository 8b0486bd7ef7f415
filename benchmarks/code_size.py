"""The megakernel's machine code, per function: sizes and a hash of the kernel's text, from the built library's cubin.

    python benchmarks/code_size.py [--defines MK_X=1,...] [--top 30] [--profile]

Builds the library as the backend would (kernel/build.py; $MEGAKERNEL_KERNEL_DEFINES or --defines select the switches;
nvcc is needed, no GPU), then reads the sm_90a cubin inside it: the size of every device function (noinline ones
are their own symbols; inlined code counts in its caller) and a hash of `.text.mk_decode`. Two uses:
- a refactor that should not change the code: the hash before and after is the same;
- the instruction cache: the kernel's text is ~1.25 MB, every task kind's hot path runs on whichever SM claims it,
  and a cold pass costs L2 round trips per miss (TOPK: ~5 us cold against ~2.9 warm, SPEED_NOTES' twentieth
  session). The sizes say which paths are large.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import struct
import subprocess
from pathlib import Path

from megakernel.kernel import build

EM_CUDA = 190


def _sections(elf: bytes) -> list[tuple[str, int, int, int, int]]:
    """(name, type, offset, size, link) of every section of a 64-bit ELF."""
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    raw = [struct.unpack_from("<IIQQQQI", elf, shoff + i * shentsize) for i in range(shnum)]
    strtab = raw[shstrndx][4]

    def name(off: int) -> str:
        return elf[strtab + off:elf.index(b"\0", strtab + off)].decode(errors="replace")
    return [(name(r[0]), r[1], r[4], r[5], r[6]) for r in raw]


def kernel_cubin(lib: bytes) -> bytes:
    """The embedded CUDA ELF that holds mk_decode's text."""
    for m in re.finditer(rb"\x7fELF", lib):
        elf = lib[m.start():]
        if elf[4] != 2 or struct.unpack_from("<H", elf, 0x12)[0] != EM_CUDA:
            continue
        try:
            if any(n == ".text.mk_decode" for n, *_ in _sections(elf)):
                return elf
        except (struct.error, ValueError):
            continue
    raise SystemExit("no cubin with .text.mk_decode in the library")


def functions(elf: bytes) -> tuple[list[tuple[int, str]], bytes]:
    """(size, name) of every function symbol, largest first, and the kernel's text."""
    secs = _sections(elf)
    text = next(elf[o:o + s] for n, _, o, s, _ in secs if n == ".text.mk_decode")
    sym = next(sec for sec in secs if sec[1] == 2)      # SHT_SYMTAB
    strtab = secs[sym[4]][2]
    out = []
    for i in range(sym[3] // 24):
        st_name, st_info, _, _, _, st_size = struct.unpack_from("<IBBHQQ", elf, sym[2] + i * 24)
        if st_info & 0xF == 2:                           # STT_FUNC
            out.append((st_size, elf[strtab + st_name:elf.index(b"\0", strtab + st_name)].decode(errors="replace")))
    return sorted(out, reverse=True), text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--defines", default=None, help="switches as MEGAKERNEL_KERNEL_DEFINES takes them")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="the profiling build (MK_PROFILE: what a trace runs)")
    args = ap.parse_args()
    if args.defines is not None:
        os.environ["MEGAKERNEL_KERNEL_DEFINES"] = args.defines
    lib = Path(build.build("sm_90a", (build.PROFILE_FLAGS if args.profile else ()) + build.switch_flags()))
    funcs, text = functions(kernel_cubin(lib.read_bytes()))
    names = [n.replace("$mk_decode$", "") for _, n in funcs]
    try:
        names = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                               check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        pass
    print(f"{lib}: .text.mk_decode {len(text)} bytes, sha1 {hashlib.sha1(text).hexdigest()[:12]}")
    print("(mk_decode's own size is the whole section; its noinline functions lie inside it)")
    for (size, _), name in list(zip(funcs, names))[:args.top]:
        print(f"{size:9d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
