"""The kernel sources compile with nvcc for sm_90a (no GPU needed); the cache key follows sources and flags."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from megakernel.kernel import build


def test_compiles_for_sm90a(tmp_path, monkeypatch):
    if build.find_nvcc() is None:
        pytest.skip("nvcc not installed: cannot check that the CUDA sources compile")
    monkeypatch.setenv("MEGAKERNEL_CACHE_DIR", str(tmp_path))
    lib = build.build("sm_90a")
    assert lib.exists()
    check_build_log((lib.parent / "build.log").read_text())
    # cached: a second call does not rebuild
    assert build.build("sm_90a") == lib
    # benchmarks/code_size.py reads the kernel's functions out of the library's cubin
    code_size = code_size_module()
    funcs, text = code_size.functions(code_size.kernel_cubin(lib.read_bytes()))
    sizes = {name.replace("$mk_decode$", ""): size for size, name in funcs}
    assert sizes["mk_decode"] == len(text) > 0
    assert any("topk_route" in n for n in sizes) and any("moe_worker_pages" in n for n in sizes)
    assert sum(size for name, size in sizes.items() if name != "mk_decode") < len(text)


def code_size_module():
    """benchmarks/code_size.py (it reads the library's cubin)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import code_size

    return code_size


def check_build_log(log: str, spills_allowed: bool = False) -> None:
    """mk_decode does not spill registers (unless spills_allowed: the profiling build), and its static shared memory
    stays inside what the plans leave it (opcodes.SMEM_RESERVE). (Also run by test_two_blocks in the two-block build's
    interpreter.)"""
    m = re.search(r"Function properties for mk_decode\s+(\d+) bytes stack frame, (\d+) bytes spill stores", log)
    assert m, log[-2000:]
    assert spills_allowed or int(m.group(2)) == 0, "mk_decode spills registers"
    m = re.search(r"Compiling entry function 'mk_decode'.*?Used \d+ registers.*?(\d+) bytes smem", log, re.S)
    assert m, log[-2000:]
    assert int(m.group(1)) <= build.opcodes.SMEM_RESERVE, f"{m.group(1)} bytes of static shared memory"


@pytest.mark.parametrize("defines", ["MK_MOE_LOCAL=0", "MK_SMALL_VEC=1", "MK_SMALL_VEC=3",
                                     "MK_ATTN_BULK=0", "MK_ATTN_BULK=0,MK_ATTN_PAD=0,MK_ATTN_MATH=0",
                                     "MK_ATTN_BULK=2,MK_EARLY_TABLES=0", "MK_CONST_TABLES=1",
                                     "MK_ATTN_DSPLIT=0", "MK_ATTN_BULK=0,MK_ATTN_TABLE=0", "MK_PG_SEG_TC=1",
                                     "MK_PG_CLAIM_LEAD=1", "MK_PG_PROXY_FENCE=1", "MK_SMEM_ALIGN=16", "MK_PG_TC_ACC=2",
                                     "MK_EARLY_TABLES=0", "MK_ATTN_BULK=0,MK_ATTN_Q_ASYNC=0", "MK_CLAIM_FIRST=0",
                                     "MK_ATTN_Q_ASYNC=2", "MK_ATTN_PAD=0", "MK_ATTN_ISSUE=0", "MK_ATTN_MATH=0",
                                     "MK_LOADX_ASYNC=0", "MK_LATE_WEIGHTS=1", "MK_FUSED_TABLES_EARLY=1",
                                     "MK_PG_DECODE_EARLY=0",
                                     "MK_PAGE_SLOTS=4", "MK_PG_MULTI_ISSUE=1",
                                     "MK_PG_MULTI_ISSUE=1,MK_PG_POLL_CHECK=1", "MK_PG_MULTI_ISSUE=1,MK_PG_POLL_SUSPEND=1",
                                     "MK_PAGE_BYTES=32768", "MK_PAGE_BYTES=32768,MK_PG_PAGE_WARPS=2",
                                     "MK_STALL_PRINT=1", "MK_PG_TLB_WARM=1", "MK_PG_TLB_WARM=2", "MK_PG_TLB_WARM=3",
                                     "MK_PG_ANY_SLOT=1", "MK_PAGE_BYTES=32768,MK_PG_PAGE_WARPS=2,MK_PG_ANY_SLOT=1",
                                     "MK_PG_ANY_SLOT=1,MK_STALL_PRINT=1",
                                     "MK_PG_ANY_SLOT=1,MK_PG_POLL_SUSPEND=1",
                                     "MK_PAGE_BYTES=32768,MK_PG_PAGE_WARPS=2,MK_PG_RING_COUNTERS=1"])
def test_switch_builds_compile_without_spills(tmp_path, monkeypatch, defines):
    """The builds the switches select besides the default (MK_MOE_LOCAL=0: the MoE worker's routing read from L2 per
    item; MK_SMALL_VEC=1: NORM in three or four waves of loads; MK_SMALL_VEC=3: the combine in one round trip;
    MK_ATTN_BULK=0: attention's K/V by 16-byte cp.async, alone and as the default before session 27 (no padding, the old
    math); MK_ATTN_BULK=2: by tensor copies (with MK_EARLY_TABLES=0: beside the early loads the tensor-copy build spills
    12 bytes of the persistent loop's task bookkeeping, session 24); MK_CONST_TABLES=1: the layer tables in constant
    memory too; MK_ATTN_DSPLIT=0: attention without its two-warps-per-slice variant; MK_ATTN_TABLE=0 (on the cp.async
    path): each KV block segment looked up as it goes; MK_PG_SEG_TC=1: the paged worker's one-row pages on tensor cores;
    MK_PG_CLAIM_LEAD=1: its next claim one page before an item's end; MK_PG_PROXY_FENCE=1: a proxy fence before each
    page's copy (the default until session 34); MK_SMEM_ALIGN=16: dynamic shared memory from the static section's
    16-byte end (the default before session 24); MK_PG_TC_ACC=2: the paged worker's several-row pages with two
    accumulators per chain; MK_EARLY_TABLES=0: the record, abort flag and tables loaded a round trip later;
    MK_ATTN_Q_ASYNC=0 (cp.async path) and 2 (bulk path): attention's Q rows by register loads, or by cp.async;
    MK_CLAIM_FIRST=0: a task's next claim by thread 0 after its signal's release; MK_ATTN_PAD=0, MK_ATTN_ISSUE=0,
    MK_ATTN_MATH=0: each of session 27's attention defaults off; MK_LOADX_ASYNC=0: GEMV input rows through registers,
    four loads in flight per thread; MK_LATE_WEIGHTS=1: records with FLAG_LATE_WEIGHTS issue their weights after their
    input rows; MK_FUSED_TABLES_EARLY=1: a fused tile's norm tables read before its wait; MK_PG_DECODE_EARLY=0: the
    paged loader's item decode after the item slot's wait (the default before session 36); MK_PAGE_SLOTS=4: four
    item slots; MK_PG_MULTI_ISSUE=1: an item's pages issued by the loader's lanes at once, with MK_PG_POLL_CHECK=1
    as measured in session 37, and with MK_PG_POLL_SUSPEND=1 as in session 38; MK_PAGE_BYTES=32768: 32 KB ring pages
    and copies, alone and with MK_PG_PAGE_WARPS=2, two computing warps per page; MK_STALL_PRINT=1: every wait left on
    an abort or a watchdog prints where it was; MK_PG_TLB_WARM=1/2/3: the routed experts' 2 MB regions prefetched by
    the worker's loader (copy engine, load path) or by the block that routed the layer; MK_PG_ANY_SLOT=1: each page
    into the first free ring page, alone, in the H200's 32 KB two-warp build, with the stall prints and with
    MK_PG_POLL_SUSPEND=1 (its end markers poll through MULTI_ISSUE's helper);
    MK_PG_RING_COUNTERS=1: the in-order loader's ring slot and lap stepped, not divided, in the H200's build): each
    compiles, its entry function does not spill, its static shared memory fits the reserve, and it reports the item
    slots, page size and warps per page the plans lay out."""
    if build.find_nvcc() is None:
        pytest.skip("nvcc not installed")
    monkeypatch.setenv("MEGAKERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", defines)
    lib = build.build("sm_90a", build.switch_flags())
    check_build_log((lib.parent / "build.log").read_text())
    # the library reports the item slots its paged worker was built with, as the plans lay them out (loads without a
    # GPU: no CUDA call runs)
    assert ctypes.CDLL(str(lib)).mk_page_slots() == build.page_slots()
    assert ctypes.CDLL(str(lib)).mk_page_bytes() == build.page_bytes()
    assert ctypes.CDLL(str(lib)).mk_page_warps() == build.page_warps()
    # dynamic shared memory starts where each kernel's static section ends (1 KB reserved + its own): MK_SMEM_ALIGN
    # pads that section to a multiple of the alignment
    align = build.switch_value("MK_SMEM_ALIGN")
    for kernel, size in static_shared_sections(lib).items():
        assert size % align == 0, (kernel, size, align)


@pytest.mark.parametrize("defines", ["", "MK_PG_PAGE_STATS=1,MK_ATTN_STATS=1", "MK_FUSED_SERIAL=4"])
def test_profiling_builds_compile(tmp_path, monkeypatch, defines):
    """The profiling build (MK_PROFILE: every task stamped, kernel/timeline.py) that a device call's trace runs, plain
    and with its diagnostic switches (the paged items' page sums, the attention splits' chunk sums, the fused norm's
    two passes), compiles and its static shared memory fits the reserve. (It may spill: the stamps cost registers;
    it is not the build that is timed.)"""
    if build.find_nvcc() is None:
        pytest.skip("nvcc not installed")
    monkeypatch.setenv("MEGAKERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", defines)
    lib = build.build("sm_90a", build.PROFILE_FLAGS + build.switch_flags())
    log = (lib.parent / "build.log").read_text()
    assert "-DMK_PROFILE=1" in log and all(f"-D{d}" in log for d in filter(None, defines.split(",")))
    check_build_log(log, spills_allowed=True)


def static_shared_sections(lib) -> dict[str, int]:
    """Each kernel's static shared-memory section in the library's cubin (.nv.shared.<kernel>), in bytes."""
    code_size = code_size_module()
    elf = code_size.kernel_cubin(lib.read_bytes())
    return {n[len(".nv.shared."):]: size for n, _, _, size, _ in code_size._sections(elf)
            if n.startswith(".nv.shared.mk_")}


def test_switch_defaults_match_the_sources():
    """Every kernel switch has one default: the sources' (and the generated header's) `#ifndef NAME / #define NAME v`
    and build.KERNEL_SWITCHES agree on the names and the values (a build passes -D only for a value away from the
    default, so a drift would compile something other than what the build's flags say), and a switch taken out of the
    sources is out of the table too."""
    pattern = re.compile(r"^#ifndef (MK_\w+)\n#define \1 (-?\d+)\n#endif", re.M)
    found = {}
    for src, text in sorted(build.source_texts().items()):   # (the generated header's MK_PAGE_SLOTS included)
        for name, value in pattern.findall(text):
            assert name not in found, f"{name} defaulted twice ({src})"
            found[name] = int(value)
    found.pop("MK_PROFILE")                 # the profiling build's flag (PROFILE_FLAGS), not a switch
    assert found == build.KERNEL_SWITCHES


def test_sources_cover_every_included_file():
    """build.SOURCES (what the cache key hashes, the build copies and the switch check reads) holds every file
    mk_kernel.cu includes, directly or through another source: a header left out would leave its switches out of
    test_switch_defaults_match_the_sources and its edits out of the cache key (and fail a fresh build)."""
    include = re.compile(r'^#include "([^"]+)"', re.M)
    seen, todo = set(), ["mk_kernel.cu"]
    while todo:
        name = todo.pop()
        if name in seen or name == "mk_generated.h":      # (the header opcodes.py generates: hashed as text)
            continue
        seen.add(name)
        todo += include.findall((build.CSRC / name).read_text())
    assert seen <= set(build.SOURCES), sorted(seen - set(build.SOURCES))


def test_key_changes_with_header(monkeypatch):
    k1 = build.build_key("sm_90a", "v")
    monkeypatch.setattr(build.opcodes, "generate_header", lambda: "// other\n")
    assert build.build_key("sm_90a", "v") != k1
    assert build.build_key("sm_90", "v") != build.build_key("sm_90a", "v")


def test_kernel_switches_from_the_environment(monkeypatch):
    """$MEGAKERNEL_KERNEL_DEFINES turns a known switch into an nvcc -D flag (part of the build hash) only when it
    differs from the default; an unknown name or a non-integer is refused by name."""
    import pytest

    from megakernel.kernel import build

    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_PG_PROXY_FENCE=1")
    assert build.switch_flags() == ("-DMK_PG_PROXY_FENCE=1",)
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_PG_PROXY_FENCE=0")
    assert build.switch_flags() == ()
    # a list given as text (scripts/prebuild_kernels.py) instead of the environment's
    assert build.switch_flags("MK_PG_PROXY_FENCE=1") == ("-DMK_PG_PROXY_FENCE=1",)
    assert build.switch_flags("") == ()
    for bad in ("MK_NOPE=1", "MK_PG_PROXY_FENCE=yes", "MK_SIGNAL_FENCE=1"):   # (the last: a switch since removed)
        monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", bad)
        with pytest.raises(build.BuildError, match="MEGAKERNEL_KERNEL_DEFINES"):
            build.switch_flags()


def test_gemv_stream_microbenchmark_compiles():
    """benchmarks/gemv_stream.cu includes the kernel's loader and GEMV core unchanged: it must keep compiling as they
    change (the benchmark itself needs an sm_90 GPU)."""
    import sys
    from pathlib import Path

    if build.find_nvcc() is None:
        pytest.skip("nvcc not installed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import gemv_stream
    finally:
        sys.path.pop(0)
    so = gemv_stream.compile_bench()
    assert hasattr(so, "gemv_stream_launch")
    wbuf, smem = gemv_stream.smem_for(24, 2048, 1, double=True)      # two 96 KB buffers fit, two 128 KB do not
    assert wbuf == 24 * 2048 * 2 and smem <= build.opcodes.SMEM_LIMIT - build.opcodes.SMEM_RESERVE
    assert gemv_stream.smem_for(32, 2048, 1, double=True)[1] > build.opcodes.SMEM_LIMIT


def test_card_switches_sit_under_the_environment(monkeypatch):
    """select_card_switches (the backend names its card's row of tuning.CARD_SWITCHES): those switches become the
    build's and the plan layout's (page_bytes, page_warps) unless $MEGAKERNEL_KERNEL_DEFINES sets them; the card's
    build has the flags its switch list names (so scripts/prebuild_kernels.py's cache serves it); unknown names are
    refused; nothing selected: the defaults. (tests/conftest.py restores the selection after the test.)"""
    from megakernel.kernel.tuning import card_switches

    monkeypatch.delenv("MEGAKERNEL_KERNEL_DEFINES", raising=False)
    monkeypatch.delenv("MEGAKERNEL_CARD_SWITCHES", raising=False)
    build.select_card_switches({})
    assert build.switch_flags() == () and build.page_bytes() == build.opcodes.PAGE_BYTES
    h200 = card_switches("NVIDIA H200")
    assert h200 == {"MK_PAGE_BYTES": 32768, "MK_PG_PAGE_WARPS": 2}
    build.select_card_switches(h200)
    assert build.switch_flags() == ("-DMK_PAGE_BYTES=32768", "-DMK_PG_PAGE_WARPS=2")
    assert build.page_bytes() == 32768 and build.page_warps() == 2
    build.select_card_switches({})
    assert build.switch_flags("MK_PAGE_BYTES=32768,MK_PG_PAGE_WARPS=2") == ("-DMK_PAGE_BYTES=32768",
                                                                             "-DMK_PG_PAGE_WARPS=2")
    build.select_card_switches(h200)
    # the environment wins per switch; the card's others stay
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_PAGE_BYTES=16384,MK_PG_PAGE_WARPS=1")
    assert build.switch_flags() == () and build.page_bytes() == 16384 and build.page_warps() == 1
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_PG_PROXY_FENCE=1")
    assert build.switch_flags() == ("-DMK_PAGE_BYTES=32768", "-DMK_PG_PAGE_WARPS=2", "-DMK_PG_PROXY_FENCE=1")
    with pytest.raises(build.BuildError, match="unknown kernel switches"):
        build.select_card_switches({"MK_NOPE": 1})
    assert build.card_switch_selection() == h200                 # (a refused selection changes nothing)


def test_switch_value_reads_the_selected_build(monkeypatch):
    """switch_value: a switch's default, or the value $MEGAKERNEL_KERNEL_DEFINES gives it (the backend refuses plan
    knobs the build cannot run, e.g. worker_topk without MK_MOE_LOCAL)."""
    monkeypatch.delenv("MEGAKERNEL_KERNEL_DEFINES", raising=False)
    assert build.switch_value("MK_MOE_LOCAL") == build.KERNEL_SWITCHES["MK_MOE_LOCAL"] == 1
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_MOE_LOCAL=0,MK_ATTN_BULK=2")
    assert build.switch_value("MK_MOE_LOCAL") == 0 and build.switch_value("MK_ATTN_BULK") == 2
    assert build.switch_value("MK_GEMV_TC") == build.KERNEL_SWITCHES["MK_GEMV_TC"]


def test_builds_without_the_paged_worker_get_plain_plans(monkeypatch):
    """MK_MOE_LOCAL=0 builds have no paged MoE worker (csrc/mk_moe.cuh compiles it under MK_MOE_LOCAL): the default
    knobs turn moe_pages off for them, so no plan is paged (its 256 KB items would not fit the plain worker), and
    asking for moe_pages there is refused with a clear error; the default build keeps its paged plans."""
    from megakernel.config import north_mini_code_config
    from megakernel.kernel.backend import DEFAULT_TUNING, build_knobs, check_build_runs
    from megakernel.kernel.plan import tiling_plans
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)
    plans_for = lambda tuning: tiling_plans(cfg, layout, 16, True, n_workers=132, **build_knobs(tuning))  # noqa: E731
    monkeypatch.delenv("MEGAKERNEL_KERNEL_DEFINES", raising=False)
    default = plans_for(dict(DEFAULT_TUNING))
    assert any(p.pg_n for p in default)
    check_build_runs(default)
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_MOE_LOCAL=0")
    local0 = plans_for(dict(DEFAULT_TUNING))
    assert not any(p.pg_n for p in local0) and all(p.queue_dn_lag == 0 for p in local0)
    check_build_runs(local0)
    with pytest.raises(ValueError, match="moe_pages needs the kernel's MK_MOE_LOCAL=1"):
        check_build_runs(plans_for({**DEFAULT_TUNING, "moe_pages": 8}))


def test_constant_tables_build_refuses_deeper_models(monkeypatch):
    """MK_CONST_TABLES=1 keeps the layer tables in constant memory for at most MAX_TABLE_LAYERS layers: North's plans
    run under it, a model of more layers is refused with a clear error (not a kernel reading past the copy); the
    default build takes any depth."""
    import dataclasses

    from megakernel.config import north_mini_code_config
    from megakernel.kernel.backend import check_build_runs
    from megakernel.kernel.plan import ModelPlan
    from megakernel.kv.cache import KVLayout

    north = north_mini_code_config()
    n = build.opcodes.MAX_TABLE_LAYERS + 1
    deep = dataclasses.replace(north, num_layers=n, layer_types=tuple(north.layer_types[i % 4] for i in range(n)),
                               mlp_layer_types=tuple(north.mlp_layer_types[min(i, 1)] for i in range(n)))
    plan = lambda cfg: [ModelPlan(cfg, KVLayout.for_model(cfg, 64), max_batch=1, n_workers=132)]  # noqa: E731
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_CONST_TABLES=1")
    check_build_runs(plan(north))
    with pytest.raises(ValueError, match="MK_CONST_TABLES"):
        check_build_runs(plan(deep))
    monkeypatch.delenv("MEGAKERNEL_KERNEL_DEFINES")
    check_build_runs(plan(deep))


def test_dependent_switch_defaults(monkeypatch):
    """MK_MOE_LOCAL=0 builds leave out attention's second variant unless asked (their loop spills beside it);
    asked for, it stays; the default build has it. Likewise MK_CONST_TABLES=1 builds and attention's table copy, and
    the builds whose mk_decode spills beside MK_LOADX_ASYNC=1."""
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_MOE_LOCAL=0")
    assert build.switch_flags() == ("-DMK_MOE_LOCAL=0", "-DMK_ATTN_DSPLIT=0")
    assert build.switch_value("MK_ATTN_DSPLIT") == 0
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_MOE_LOCAL=0,MK_ATTN_DSPLIT=1")
    assert build.switch_flags() == ("-DMK_MOE_LOCAL=0",) and build.switch_value("MK_ATTN_DSPLIT") == 1
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "")
    assert build.switch_flags() == () and build.switch_value("MK_ATTN_DSPLIT") == 1
    # MK_CONST_TABLES=1 builds read attention's block table per segment (their loop spills beside the table copy),
    # and load K/V by cp.async (beside the bulk copies, the default since session 27, they spill 4 bytes)
    # (and so keep GEMV inputs in registers: MK_LOADX_ASYNC=1 spills 12 bytes beside the cp.async attention)
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_CONST_TABLES=1")
    assert build.switch_flags() == ("-DMK_CONST_TABLES=1", "-DMK_ATTN_TABLE=0", "-DMK_ATTN_BULK=0",
                                    "-DMK_LOADX_ASYNC=0")
    assert build.switch_value("MK_ATTN_TABLE") == 0 and build.switch_value("MK_ATTN_BULK") == 0
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_CONST_TABLES=1,MK_ATTN_BULK=1")
    assert build.switch_value("MK_ATTN_BULK") == 1 and build.switch_value("MK_LOADX_ASYNC") == 1
    assert build.switch_flags() == ("-DMK_CONST_TABLES=1", "-DMK_ATTN_TABLE=0")
    # MK_LOADX_ASYNC follows the attention's copies and MK_PG_SEG_TC; asked for, it stays
    for defines in ("MK_ATTN_BULK=0", "MK_ATTN_BULK=2", "MK_PG_SEG_TC=1"):
        monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", defines)
        assert build.switch_value("MK_LOADX_ASYNC") == 0 and build.switch_flags()[-1] == "-DMK_LOADX_ASYNC=0"
        monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", defines + ",MK_LOADX_ASYNC=1")
        assert build.switch_value("MK_LOADX_ASYNC") == 1 and "-DMK_LOADX_ASYNC=0" not in build.switch_flags()


def compile_microbenchmark(name: str, tmp_path) -> list[int]:
    """benchmarks/<name>.cu compiled for sm_90a (skipped without nvcc): the spill stores of each of its functions."""
    import subprocess
    from pathlib import Path

    nvcc = build.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not installed")
    src = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.cu"
    res = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                          str(src), "-o", str(tmp_path / name)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return [int(n) for n in re.findall(r"(\d+) bytes spill stores", res.stderr)]


def test_mem_latency_microbenchmark_compiles(tmp_path):
    """benchmarks/mem_latency.cu (a dependent access and each signalling primitive under streaming load) compiles for
    sm_90a without spills (running it needs an sm_90 GPU)."""
    spills = compile_microbenchmark("mem_latency", tmp_path)
    assert spills and not any(spills), spills


def test_sm_stream_and_page_math_microbenchmarks_compile(tmp_path):
    """benchmarks/sm_stream.cu (HBM bandwidth by streaming SMs and depth), benchmarks/page_math.cu (the paged
    worker's page product, CUDA cores against tensor cores), benchmarks/smem_align.cu (bulk copies by the
    shared-memory offset they land at), benchmarks/pg_stream.cu (the paged worker's protocol alone, its
    candidates as knobs) and benchmarks/mbar_probe.cu (mbarrier words and a one- or two-consumer ping-pong, for the
    racecheck-only stall) and benchmarks/tma_issue.cu (bursts and rings of bulk copies per SM, by issuing thread and
    address pattern) compile for sm_90a without spills (running them needs an sm_90 GPU)."""
    for name in ("sm_stream", "page_math", "smem_align", "pg_stream", "mbar_probe", "tma_issue"):
        spills = compile_microbenchmark(name, tmp_path)
        assert spills and not any(spills), (name, spills)


def test_attn_stream_microbenchmark_compiles(tmp_path):
    """benchmarks/attn_stream.cu (attention's copy pattern, with and without the split's math: the kernel's own,
    csrc/mk_attn_math.cuh, in both MK_ATTN_MATH forms) compiles for sm_90a without spills in any mode (the benchmark
    itself needs an sm_90 GPU)."""
    spills = compile_microbenchmark("attn_stream", tmp_path)
    assert len(spills) == 10 and not any(spills), spills


def test_speed_probe_switch_is_refused_without_opt_in(monkeypatch):
    """MK_GU_ONE_REGION_PROBE times a weight layout the weights do not have (its outputs are wrong): loading its
    build is refused unless $MEGAKERNEL_SPEED_PROBE=1, so no engine serves it by a stray define."""
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_GU_ONE_REGION_PROBE=1")
    monkeypatch.delenv("MEGAKERNEL_SPEED_PROBE", raising=False)
    with pytest.raises(build.BuildError, match="MEGAKERNEL_SPEED_PROBE=1"):
        build.load()
