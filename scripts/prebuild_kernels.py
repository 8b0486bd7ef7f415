"""Compile kernel builds here (no GPU needed) into a cache folder a device call carries, so its minutes go to
measuring instead of nvcc (~25 s a build there, as here).

    python scripts/prebuild_kernels.py [--cache .mkcache] SPEC ...

SPEC: a switch list as $MEGAKERNEL_KERNEL_DEFINES takes it ("default" for none), with "+profile" for the profiling
build, e.g. `default MK_PG_MULTI_ISSUE=1 MK_PG_PAGE_STATS=1+profile`. The cache key is build.load's (the switch order
as written, the nvcc version): the device's nvcc must print the same version line, or it compiles again (harmless).
The device script copies the folder into its cache only after a build from it loads there (scripts/carried_cache.sh).
A card with a row in megakernel/kernel/tuning.py's CARD_SWITCHES builds that row's switches as its default (an H200:
`MK_PAGE_BYTES=32768,MK_PG_PAGE_WARPS=2`, an H100 SXM: `MK_PG_TLB_WARM=3`; prebuild that spec for it), and "default"
there means that build unless $MEGAKERNEL_CARD_SWITCHES=0; this script builds exactly the SPECs given.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megakernel.kernel import build  # noqa: E402


def flags_of(spec: str) -> tuple[str, ...]:
    """The nvcc flags build.load would pass for SPEC (switch list [+profile])."""
    defines, _, extra = spec.partition("+")
    if extra not in ("", "profile"):
        raise SystemExit(f"bad spec {spec!r}: want DEFINES or DEFINES+profile")
    return (build.PROFILE_FLAGS if extra else ()) + build.switch_flags("" if defines == "default" else defines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--cache", default=".mkcache")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    os.environ["MEGAKERNEL_CACHE_DIR"] = str(Path(args.cache).resolve())
    flag_sets = [flags_of(s) for s in args.specs]   # (all parsed before any compile: a typo fails at once)

    def one(spec_flags: tuple[str, tuple[str, ...]]) -> str:
        spec, flags = spec_flags
        t0 = time.time()
        lib = build.build("sm_90a", flags)
        return f"{spec}: {lib.parent.name} ({time.time() - t0:.0f} s)"

    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(one, zip(args.specs, flag_sets)):
            print(line, flush=True)


if __name__ == "__main__":
    main()
