"""benchmarks/layer_bandwidth.py, page_stats.py and attn_stats.py on a trace emulated from a real task list (CPU):
the tools the speed notes quote run on a saved .npz and their figures add up. (On the GPU they read the profiling
build's traces; MK_PG_PAGE_STATS fills the paged items' page sums and MK_ATTN_STATS the attention splits' chunk sums,
which an emulated trace has none of.)"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kernel_helpers import emulated_trace
from megakernel.kernel import opcodes as O
from megakernel.kernel import timeline as T

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    raw, _, _ = emulated_trace()
    path = tmp_path_factory.mktemp("trace") / "emulated.npz"
    T.save_raw(raw, str(path))
    return str(path), raw


def test_layer_bandwidth_bins_add_up(trace):
    path, raw = trace
    res = _load("layer_bandwidth").layer_profile(path, layer=1, bin_us=0.5)
    assert res["layer_us"] > 0 and res["bins"]
    rates = np.array([b["gb_per_s"] for b in res["bins"]])
    assert (rates >= 0).all() and rates.max() > 0
    # the layer's mean rate is its bins' bytes over its span (the last bin may run past the next layer's start)
    n = len(rates)
    assert res["layer_gb_per_s"] <= rates.sum() * res["bin_us"] / res["layer_us"] + 1.0
    assert res["layer_gb_per_s"] >= rates[:n - 1].sum() * res["bin_us"] / res["layer_us"] - 1.0
    # no more bytes than the whole step read
    assert res["layer_gb_per_s"] * res["layer_us"] * 1e3 <= raw.task_bytes.sum() + 1.0


def test_page_stats_reads_the_page_sums(trace, tmp_path):
    """Items with MK_PG_PAGE_STATS marks (sums in ns) come out as the page sums' percentiles, their stamps' gaps
    as the phases, and each worker's rate as its bytes over its span; without marks, no page sums."""
    _, raw = trace
    F = {k: i for i, k in enumerate(O.PROF_FIELDS)}
    PB = {k: i for i, k in enumerate(O.PROF_BLOCK_FIELDS)}
    blocks = raw.blocks.copy()                          # %globaltimer stamps: clock = ns on every block
    blocks[:, PB["c_start"]], blocks[:, PB["c_end"]] = blocks[:, PB["g_start"]], blocks[:, PB["g_end"]]
    t0 = int(blocks[:, PB["g_start"]].max())
    rows = []
    for k in range(4):                                  # 4 gate/up items, two per worker block
        r = np.full(O.PROF_INTS, -1, dtype=np.int64)
        r[F["block"]], r[F["sm"]], r[F["op"]], r[F["layer"]], r[F["arg"]] = k % 2, k % 2, O.PROF_ITEM_GU, 1, k
        base = t0 + 1000 * k
        for name, off in (("claim", 0), ("issued", 100), ("waited", 150), ("landed", 400), ("computed", 900),
                          ("end", 1000)):
            r[F[name]] = base + off
        # ns; m1's high half: 2 pages waited for, m3's: their flights' sum, 6 us
        # (m0's high half: the loader's decode, 100 ns; m2's: its time inside the pages' issue, 1500 ns)
        r[F["m0"]], r[F["m1"]] = 8000 + k + (100 << 32), 200 + (2 << 32)
        r[F["m2"]], r[F["m3"]] = 3000 + (1500 << 32), 50 + (6000 << 32)
        rows.append(r)
    items = np.stack(rows)
    path = tmp_path / "with_items.npz"
    T.save_raw(T.RawProfile(raw.tasks, items, blocks, raw.records, raw.task_bytes, {O.PROF_ITEM_GU: 131072}),
               str(path))
    res = _load("page_stats").analyse(str(path), layer=1)
    assert res["page_sums"] is True
    r = res["kinds"]["gate/up"]["layer"]
    assert r["items"] == 4 and r["bytes"] == 131072
    assert r["issued->landed us"] == [0.3, 0.3, 0.3] and r["landed->computed us"] == [0.5, 0.5, 0.5]
    assert r["math us (page sum)"] == [3.0, 3.0, 3.0] and r["loader blocked us (page sum)"] == [0.05, 0.05, 0.05]
    assert 8.0 <= r["starved us (page sum)"][1] <= 8.01 and r["inputs us (page sum)"] == [0.2, 0.2, 0.2]
    assert r["flight us per waited-for page"] == [3.0, 3.0, 3.0] and r["waited-for pages per item"][1] == 2
    assert r["loader: decode before publish us"] == [0.1, 0.1, 0.1]
    assert r["loader: inside the pages' issue us (page sum)"] == [1.5, 1.5, 1.5]
    # worker 0 ran items 0 and 2: 2 x 128 KiB from item 0's issue to item 2's math (2800 ns)
    assert res["workers"]["count"] == 2
    assert abs(res["workers"]["gb_per_s_p10_50_90"][1] - 2 * 131072 / 2800) < 0.1
    items[:, F["m0"]:F["m3"] + 1] = -1                  # a profiling build without MK_PG_PAGE_STATS
    T.save_raw(T.RawProfile(raw.tasks, items, blocks, raw.records, raw.task_bytes, {O.PROF_ITEM_GU: 131072}),
               str(path))
    res = _load("page_stats").analyse(str(path), layer=1)
    assert res["page_sums"] is False and not any(k.endswith("(page sum)") for k in res["kinds"]["gate/up"]["layer"])


def test_attn_stats_reads_the_chunk_sums(trace, tmp_path):
    """Attention splits with MK_ATTN_STATS marks (sums in ns and a chunk count) come out per chunk, and each split's
    rate as its K/V bytes over its span; without marks, no per-chunk figures."""
    _, raw = trace
    F = {k: i for i, k in enumerate(O.PROF_FIELDS)}
    tasks = raw.tasks.copy()
    attn = raw.records[:, O.R["op"]] == int(O.Op.ATTN)
    assert attn.any()
    tasks[attn, F["m0"]], tasks[attn, F["m1"]], tasks[attn, F["m2"]], tasks[attn, F["m3"]] = 3000, 1000, 200, 4
    path = tmp_path / "with_attn_sums.npz"
    T.save_raw(T.RawProfile(tasks, raw.items, raw.blocks, raw.records, raw.task_bytes, raw.item_bytes), str(path))
    mod = _load("attn_stats")
    res = mod.analyse(str(path), layer=1)
    assert res["chunk_sums"] is True
    r = res["scopes"]["layer"]
    assert r["splits"] == int((attn & (raw.records[:, O.R["layer"]] == 1)).sum())
    assert r["chunks"] == [4.0, 4.0, 4.0] and r["wait us per chunk"] == [0.75, 0.75, 0.75]
    assert r["math us per chunk"] == [0.25, 0.25, 0.25] and r["issue us per chunk"] == [0.05, 0.05, 0.05]
    ev = T.to_timeline(T.load_raw(str(path))).tasks
    sel = attn & (ev.layer == 1) & (ev.end > ev.waited)
    span = ev.end[sel] - ev.waited[sel]
    assert r["gb_per_s"] == mod.pct(ev.nbytes[sel] / span) and r["wait share of the span"] == mod.pct(3000 / span)
    assert res["scopes"]["all"]["splits"] == int((attn & (ev.end > ev.waited)).sum())
    tasks[attn, F["m0"]:F["m3"] + 1] = -1               # a profiling build without MK_ATTN_STATS
    T.save_raw(T.RawProfile(tasks, raw.items, raw.blocks, raw.records, raw.task_bytes, raw.item_bytes), str(path))
    res = mod.analyse(str(path), layer=1)
    assert res["chunk_sums"] is False and "wait us per chunk" not in res["scopes"]["layer"]


def test_derived_json_names_the_trace_it_came_from(trace, tmp_path):
    """The scripts' --json carries the trace's commit, date, GPU, bench command and build switches (from the summary
    bench wrote beside the .npz) and the command that derived it; a trace without a summary gets the latter only."""
    src, _ = trace
    npz = tmp_path / "tl_b1.npz"
    shutil.copy(src, npz)
    run = {"commit": "abc1234", "date": "2026-12-04T18:00:00+00:00", "gpu": "NVIDIA H200",
           "command": "megakernel bench --trace tl_b1.npz", "env": {"MEGAKERNEL_KERNEL_DEFINES": "MK_PG_PAGE_STATS=1"},
           "step_us": 1.0}
    (tmp_path / "tl_b1.summary.json").write_text(json.dumps(run))
    repo = BENCH.parent
    for script, extra in (("layer_bandwidth", ["--bin-us", "0.5"]), ("page_stats", []), ("attn_stats", [])):
        out = tmp_path / f"{script}.json"
        subprocess.run([sys.executable, str(BENCH / f"{script}.py"), str(npz), "--layer", "1", *extra, "--json",
                        str(out)], check=True, cwd=repo, capture_output=True, env={**os.environ, "PYTHONPATH": str(repo)})
        res = json.loads(out.read_text())
        assert {k: res[k] for k in ("commit", "date", "gpu")} == {k: run[k] for k in ("commit", "date", "gpu")}
        assert res["trace_command"] == run["command"] and res["trace_env"] == run["env"]
        assert res["derived_by"].startswith(f"python benchmarks/{script}.py ") and "--json" in res["derived_by"]
        assert res["layer"] == 1 and "step_us" not in res
    bare = tmp_path / "bare.npz"
    shutil.copy(src, bare)
    T.write_derived_json({"x": 1}, str(tmp_path / "bare.json"), str(bare), "script")
    assert json.loads((tmp_path / "bare.json").read_text()) == {"derived_by": "script", "x": 1}


def test_sm_states_counts_at_most_the_blocks(trace):
    """benchmarks/sm_states.py: in no bin are more blocks busy than the grid has (a block runs one task at a time),
    and the layer's QKV tiles' run time (wait end to end) is all inside the window's QKV:run columns."""
    path, raw = trace
    res = _load("sm_states").sm_states(path, layer=1, bin_us=0.5, before_us=50.0)
    assert res["bins"] and res["blocks"] == len(raw.blocks)
    busy = np.array([b["busy_blocks"] for b in res["bins"]])
    assert busy.max() > 0 and (busy <= res["blocks"] + 0.1).all()
    tl = T.to_timeline(raw)
    m = (tl.tasks.op == O.Op.QKV) & (tl.tasks.layer == 1)
    want_us = float((tl.tasks.end[m] - tl.tasks.waited[m]).sum()) / 1e3
    got_us = sum(b.get("QKV:run", 0.0) for b in res["bins"]) * res["bin_us"]
    assert got_us >= want_us * 0.99 - 0.1 * len(res["bins"])       # (each bin's figure is rounded to 0.1)


def test_tma_issue_json_reads_a_full_run_as_session_43_recorded_it():
    """benchmarks/tma_issue_json.py on session 43's full tma_issue output (bursts, then rings with warm-up variants)
    gives the records its hand-made JSON holds, figure for figure."""
    run = BENCH / "results" / "speed_20261207s43" / "call1"
    rec = _load("tma_issue_json").parse((run / "tma_issue.txt").read_text())
    want = json.loads((run / "tma_issue.json").read_text())
    assert rec["gpu"] == want["gpu"] == "NVIDIA H100 80GB HBM3"
    assert rec["bursts"] == want["bursts"] and rec["rings"] == want["rings"]


def test_tma_issue_json_reads_the_layouts_mode_and_refuses_what_it_cannot_read():
    """The layouts mode's lines (an order per line, labels with item sizes) become ring records with the order in the
    config; an unreadable line is an error, not a silently missing figure."""
    mod = _load("tma_issue_json")
    text = ("# NVIDIA H200\n# layouts: 576 pages per block through a ring of 192 KB, GB/s per SM\n"
            "sms 132  16 KB ring of 12 in-order :  contiguous  70.1  local  66.0  gap  64.2  scattered2  20.5"
            "  split16  33.0\n"
            "sms  32  32 KB ring of  6 any-order:  contiguous  90.0  scattered8  41.0\n")
    rec = mod.parse(text)
    assert rec["gpu"] == "NVIDIA H200" and rec["bursts"] == []
    assert [(r["sms"], r["page_kb"], r["slots"], r["config"], r["gb_per_s_per_sm"]) for r in rec["rings"]] == [
        (132, 16, 12, "contiguous in-order", 70.1), (132, 16, 12, "local in-order", 66.0),
        (132, 16, 12, "gap in-order", 64.2), (132, 16, 12, "scattered2 in-order", 20.5),
        (132, 16, 12, "split16 in-order", 33.0), (32, 32, 6, "contiguous any-order", 90.0),
        (32, 32, 6, "scattered8 any-order", 41.0)]
    with pytest.raises(ValueError, match="unrecognised"):
        mod.parse("sms 132 garbage\n")
    with pytest.raises(ValueError, match="label without a rate"):
        mod.parse("sms 132  16 KB ring of 12 in-order :  contiguous  70.1  local\n")
