"""Compile the megakernel's CUDA sources with nvcc on first use and cache the shared library on disk.

The cache key hashes the sources, the generated header (opcodes.py), the nvcc flags, the nvcc version and the
GPU architecture, so any change rebuilds and nothing stale is ever loaded. The library is a plain `extern "C"`
launcher loaded with ctypes: no CMake, no torch extension build, no manual step.

Cache folder: $MEGAKERNEL_CACHE_DIR, else $XDG_CACHE_HOME/megakernel, else ~/.cache/megakernel.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from megakernel.kernel import opcodes

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("mk_math.cuh", "mk_async.cuh", "mk_page_math.cuh", "mk_common.cuh", "mk_loader.cuh", "mk_gemv_core.cuh",
           "mk_gemv.cuh", "mk_lm_head.cuh", "mk_norm.cuh", "mk_attention.cuh", "mk_routing.cuh", "mk_moe.cuh",
           "mk_moe_pages.cuh", "mk_pg_switches.cuh", "mk_pg_sync.cuh", "mk_pg_items.cuh", "mk_attn_layout.cuh",
           "mk_attn_math.cuh", "mk_tmap.h", "mk_peak.cuh", "mk_kernel.cu")
ARCH_FLAGS = {"sm_90a": ["-gencode=arch=compute_90a,code=sm_90a"], "sm_90": ["-gencode=arch=compute_90,code=sm_90"]}
NVCC_FLAGS = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo",
              "-Xptxas", "-v"]

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}


class BuildError(RuntimeError):
    pass


def find_nvcc() -> str | None:
    for cand in (os.environ.get("MEGAKERNEL_NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def cache_dir() -> Path:
    d = os.environ.get("MEGAKERNEL_CACHE_DIR")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megakernel"


def source_texts() -> dict[str, str]:
    texts = {name: (CSRC / name).read_text() for name in SOURCES}
    texts["mk_generated.h"] = opcodes.generate_header()
    return texts


def build_key(arch: str, nvcc_ver: str, extra_flags: tuple[str, ...] = ()) -> str:
    h = hashlib.sha256()
    for name, text in sorted(source_texts().items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    h.update(" ".join(NVCC_FLAGS + ARCH_FLAGS[arch] + list(extra_flags)).encode())
    h.update(nvcc_ver.encode())
    h.update(arch.encode())
    return h.hexdigest()[:20]


def build(arch: str = "sm_90a", extra_flags: tuple[str, ...] = (), verbose: bool = False) -> Path:
    """Return the path of the compiled library for `arch`, compiling it if the cache lacks it."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set MEGAKERNEL_NVCC or CUDA_HOME, or put nvcc on PATH)")
    ver = nvcc_version(nvcc)
    key = build_key(arch, ver, extra_flags)
    out_dir = cache_dir() / f"{arch}-{key}"
    lib = out_dir / "libmegakernel.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        if lib.exists():
            return lib
        src_dir = out_dir / "src"
        src_dir.mkdir(exist_ok=True)
        for name, text in source_texts().items():
            (src_dir / name).write_text(text)
        tmp = out_dir / f"libmegakernel.so.tmp{os.getpid()}"
        cmd = [nvcc, *NVCC_FLAGS, *ARCH_FLAGS[arch], *extra_flags, "-I", str(src_dir),
               str(src_dir / "mk_kernel.cu"), "-o", str(tmp)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        (out_dir / "build.log").write_text(" ".join(cmd) + "\n" + res.stdout + res.stderr)
        if res.returncode != 0:
            raise BuildError(f"nvcc failed ({res.returncode}); log in {out_dir / 'build.log'}:\n"
                             + res.stderr[-4000:])
        if verbose:
            print(res.stderr)
        os.replace(tmp, lib)
    return lib


PROFILE_FLAGS = ("-DMK_PROFILE=1",)     # the profiling build: every task stamped (kernel/timeline.py)
# Compile-time switches of the kernel sources a measurement may flip, with their defaults (the sources say what each
# does). $MEGAKERNEL_KERNEL_DEFINES="MK_ATTN_BULK=1" overrides them; they are nvcc flags, so part of the hash.
# (Switches whose experiment lost were removed with their code; SPEED_NOTES, twenty-sixth session, lists them.)
KERNEL_SWITCHES = {"MK_GEMV_TC": 1, "MK_GEMV_B1": 1, "MK_SMALL_VEC": 2, "MK_MOE_LOCAL": 1, "MK_REPEAT_SMALL": 1,
                   "MK_ATTN_BULK": 1, "MK_CONST_TABLES": 0, "MK_ATTN_DSPLIT": 1, "MK_ATTN_TABLE": 1,
                   "MK_PG_PAGE_STATS": 0, "MK_PG_SEG_TC": 0, "MK_PG_CLAIM_LEAD": 4, "MK_PG_PROXY_FENCE": 0,
                   "MK_PG_DECODE_EARLY": 1, "MK_PG_MULTI_ISSUE": 0, "MK_PG_POLL_CHECK": 32, "MK_PG_POLL_SUSPEND": 0,
                   "MK_SMEM_ALIGN": 128, "MK_PG_TC_ACC": 1, "MK_ATTN_STATS": 0, "MK_EARLY_TABLES": 1,
                   "MK_ATTN_Q_ASYNC": 1, "MK_CLAIM_FIRST": 1, "MK_ATTN_PAD": 1, "MK_ATTN_ISSUE": 1,
                   "MK_ATTN_MATH": 1, "MK_LOADX_ASYNC": 1, "MK_LATE_WEIGHTS": 0,
                   "MK_FUSED_SERIAL": 0, "MK_FUSED_TABLES_EARLY": 0, "MK_STALL_PRINT": 0,
                   "MK_PG_TLB_WARM": 0, "MK_PG_ANY_SLOT": 0, "MK_PG_RING_COUNTERS": 0,
                   "MK_GU_ONE_REGION_PROBE": 0,
                   "MK_PAGE_SLOTS": opcodes.PAGE_SLOTS, "MK_PAGE_BYTES": opcodes.PAGE_BYTES, "MK_PG_PAGE_WARPS": opcodes.PAGE_WARPS}
# switches that time a layout the weights do not have (wrong outputs): load refuses them unless
# $MEGAKERNEL_SPEED_PROBE=1 (MK_GU_ONE_REGION_PROBE: each gate/up item's rows read as one region, csrc/mk_moe.cuh)
SPEED_PROBES = ("MK_GU_ONE_REGION_PROBE",)
PAGE_SLOTS_RANGE = (2, 5)     # MK_PAGE_SLOTS: 5 slots' PgState still fits opcodes.PAGE_STATE_BYTES in the stats build
PAGE_BYTES_CHOICES = (16384, 32768)   # MK_PAGE_BYTES: a ring page holds a row of every item kind (8 KB at North's
                                      # q width) and the ring at least 4 pages
# switches whose default follows another's value: (switch, value of the other) -> this switch's default there
# (MK_MOE_LOCAL=0's persistent loop spills 24 bytes beside attention's second variant; MK_CONST_TABLES=1's 8 bytes
# beside attention's block table in shared memory, and 4 beside the bulk-copy attention: a CI run at f62e198)
# MK_LOADX_ASYNC=1's inlined copy loop costs mk_decode 12 spilled bytes beside the cp.async attention (MK_ATTN_BULK=0,
# also where MK_CONST_TABLES=1 selects it: a default set here counts for the entries after it), the tensor-copy
# attention and MK_PG_SEG_TC=1 (session 29; a non-inlined copy loop spilled more, in more functions): those builds
# keep the register loads.
DEPENDENT_DEFAULTS = {("MK_ATTN_DSPLIT", ("MK_MOE_LOCAL", 0)): 0, ("MK_ATTN_TABLE", ("MK_CONST_TABLES", 1)): 0,
                      ("MK_ATTN_BULK", ("MK_CONST_TABLES", 1)): 0,
                      ("MK_LOADX_ASYNC", ("MK_ATTN_BULK", 0)): 0, ("MK_LOADX_ASYNC", ("MK_ATTN_BULK", 2)): 0,
                      ("MK_LOADX_ASYNC", ("MK_PG_SEG_TC", 1)): 0}


# The running card's build switches (tuning.card_switches), set by the backend before its first load
# (select_card_switches): switch_flags applies them under $MEGAKERNEL_KERNEL_DEFINES. Empty until then, so the
# simulator, the CPU tests and the plans built without a GPU see the defaults.
_card_switches: dict[str, int] = {}


def select_card_switches(switches: dict[str, int]) -> None:
    """Make `switches` (switch name -> value: this process's card's row of tuning.CARD_SWITCHES) the defaults that
    $MEGAKERNEL_KERNEL_DEFINES overrides, for every later switch_flags / switch_value / load. One card per process:
    the plans' layouts (page_bytes, ...) and the loaded library must agree, and a second backend on a card with
    another row would change them for the first (its page layout check, check_page_layout, would then refuse)."""
    global _card_switches
    bad = sorted(set(switches) - set(KERNEL_SWITCHES))
    if bad:
        raise BuildError(f"card switches: unknown kernel switches {bad}")
    _card_switches = {k: int(v) for k, v in switches.items()}     # (one assignment: readers see old or new)


def card_switch_selection() -> dict[str, int]:
    """The card switches select_card_switches set (a copy)."""
    return dict(_card_switches)


def switch_value(name: str) -> int:
    """The value of kernel switch `name` in the build $MEGAKERNEL_KERNEL_DEFINES selects (its default if unset)."""
    for flag in switch_flags():
        key, _, val = flag[2:].partition("=")
        if key == name:
            return int(val)
    return KERNEL_SWITCHES[name]


def _checked_switch(name: str, allowed: tuple[int, ...], want: str) -> int:
    """The selected build's value of switch `name`, refused (BuildError) unless it is one of `allowed`."""
    n = switch_value(name)
    if n not in allowed:
        raise BuildError(f"{name}={n}: want {want}")
    return n


def page_slots() -> int:
    """Item slots of the paged MoE worker in the selected build (MK_PAGE_SLOTS): its plan's shared-memory layout holds
    this many items' inputs and outputs."""
    lo, hi = PAGE_SLOTS_RANGE
    return _checked_switch("MK_PAGE_SLOTS", tuple(range(lo, hi + 1)), f"{lo}..{hi}")


def page_bytes() -> int:
    """Bytes of a ring page (and of each of the paged loader's bulk copies) in the selected build (MK_PAGE_BYTES): its
    plan lays out the ring in pages of this size."""
    return _checked_switch("MK_PAGE_BYTES", tuple(PAGE_BYTES_CHOICES),
                           f"one of {', '.join(map(str, PAGE_BYTES_CHOICES))}")


def page_warps() -> int:
    """Computing warps per ring page in the selected build (MK_PG_PAGE_WARPS, 1 or 2): the plan keeps its ring pages
    times this within the block's computing warps."""
    return _checked_switch("MK_PG_PAGE_WARPS", (1, 2), "1 or 2")


def switch_flags(text: str | None = None) -> tuple[str, ...]:
    """-D flags for the switches that `text` (a switch list; None: $MEGAKERNEL_KERNEL_DEFINES) sets away from their
    defaults, over the selected card's switches (select_card_switches: those `text` does not set come first, in the
    card row's order, so a card's build is the build its switch list names, e.g. in scripts/prebuild_kernels.py)."""
    if text is None:
        text = os.environ.get("MEGAKERNEL_KERNEL_DEFINES", "")
    items = [x.strip() for x in text.strip().split(",") if x.strip()]
    named = {item.partition("=")[0] for item in items}
    card = _card_switches                     # (the selection once: select_card_switches swaps the mapping)
    # (the card's flags first: a list that names one of them puts it later, a build key of its own for the same
    # build, which only costs a compile)
    items = [f"{k}={v}" for k, v in card.items() if k not in named] + items
    flags, given = [], {}
    for item in items:
        name, _, val = item.partition("=")
        if name not in KERNEL_SWITCHES or not val.strip().lstrip("-").isdigit():
            raise BuildError(f"MEGAKERNEL_KERNEL_DEFINES: bad item {item!r} (want NAME=INT, NAME in "
                             f"{', '.join(KERNEL_SWITCHES)})")
        given[name] = int(val)
        if int(val) != KERNEL_SWITCHES[name]:
            flags.append(f"-D{name}={int(val)}")
    for (name, (other, value)), default in DEPENDENT_DEFAULTS.items():
        if name not in given and given.get(other, KERNEL_SWITCHES[other]) == value and default != KERNEL_SWITCHES[name]:
            given[name] = default            # (once where several conditions hold; later entries see it)
            flags.append(f"-D{name}={default}")
    return tuple(flags)


def load(arch: str = "sm_90a", profile: bool = False) -> ctypes.CDLL:
    """Build if needed and load the library (once per process per build). `profile`: the profiling build, a
    separate library (its flags are part of the build hash)."""
    flags = (PROFILE_FLAGS if profile else ()) + switch_flags()
    if any(f.startswith(f"-D{name}=") for f in flags for name in SPEED_PROBES) and \
            os.environ.get("MEGAKERNEL_SPEED_PROBE") != "1":
        raise BuildError(f"{', '.join(SPEED_PROBES)}: speed probes that compute wrong outputs; set "
                         "MEGAKERNEL_SPEED_PROBE=1 to time them (benchmarks only)")
    key = f"{arch}{' '.join(flags)}"
    with _lock:
        if key in _loaded:
            return _loaded[key]
        lib = ctypes.CDLL(str(build(arch, flags)))
        lib.mk_launch.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_longlong), ctypes.c_int, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p]
        lib.mk_launch.restype = ctypes.c_int
        lib.mk_num_params.restype = ctypes.c_int
        lib.mk_page_slots.restype = ctypes.c_int
        lib.mk_page_bytes.restype = ctypes.c_int
        lib.mk_page_warps.restype = ctypes.c_int
        lib.mk_error_string.argtypes = [ctypes.c_int]
        lib.mk_error_string.restype = ctypes.c_char_p
        lib.mk_device_info.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        lib.mk_device_info.restype = ctypes.c_int
        lib.mk_encode_kv.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_int]
        lib.mk_encode_kv.restype = ctypes.c_int
        lib.mk_occupancy.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        lib.mk_occupancy.restype = ctypes.c_int
        lib.mk_read_peak_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int,
                                            ctypes.c_void_p, ctypes.POINTER(ctypes.c_longlong)]
        lib.mk_read_peak_launch.restype = ctypes.c_int
        if lib.mk_num_params() != opcodes.NUM_PARAMS:
            raise BuildError("the loaded library disagrees with opcodes.py on the parameter count")
        _loaded[key] = lib
        return lib


if __name__ == "__main__":  # python -m megakernel.kernel.build [arch] [--profile]: compile, print the report
    import sys

    arch = next((a for a in sys.argv[1:] if not a.startswith("--")), "sm_90a")
    path = build(arch, PROFILE_FLAGS if "--profile" in sys.argv else ())
    print(path)
    print((path.parent / "build.log").read_text())
