"""The SM timeline tools on a trace emulated from a real task list (CPU): invariants, summary, critical path,
Chrome trace and PNG. The GPU test (test_gpu_profile.py) runs the same checks on the profiling build's trace."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kernel_helpers import decode_batch, emulated_trace, make_cfg, prefill_state, tiny_weights
from megakernel.kernel import opcodes as O
from megakernel.kernel import timeline as T
from megakernel.kernel.plan import ModelPlan
from megakernel.kernel.schedule import build_tasks, step_inputs


@pytest.fixture(scope="module")
def emulated():
    return emulated_trace()


def test_emulated_trace_meets_the_invariants(emulated):
    raw, tl, _ = emulated
    assert T.check_invariants(raw, tl) == []


def test_invariant_checks_catch_broken_traces(emulated):
    raw, tl, tasks = emulated
    # a consumer whose wait ends before its producer ended
    rec = raw.records
    i = int(np.flatnonzero(rec[:, O.R["op"]] == O.Op.ATTN)[0])
    bad = raw.tasks.copy()
    f = {n: k for k, n in enumerate(O.PROF_FIELDS)}
    bad[i, f["waited"]] = bad[i, f["claim"]]
    bad[i, f["issued"]] = bad[i, f["claim"]]
    broken = T.RawProfile(bad, raw.items, raw.blocks, rec, raw.task_bytes, raw.item_bytes)
    found = T.check_invariants(broken, T.to_timeline(broken), tol_ns=0)
    assert any("before their producers ended" in v for v in found), found
    # a task recorded twice (another one missing)
    dup = raw.tasks.copy()
    dup[3] = dup[2]
    broken = T.RawProfile(dup, raw.items, raw.blocks, rec, raw.task_bytes, raw.item_bytes)
    found = T.check_invariants(broken, T.to_timeline(broken))
    assert any("without their record" in v for v in found), found
    # stamps out of order
    rev = raw.tasks.copy()
    rev[5, f["end"]] = rev[5, f["claim"]] - 10
    broken = T.RawProfile(rev, raw.items, raw.blocks, rec, raw.task_bytes, raw.item_bytes)
    assert any("out of order" in v for v in T.check_invariants(broken, T.to_timeline(broken)))


def test_summary_accounts_for_every_task(emulated):
    raw, tl, tasks = emulated
    s = T.summarize(tl)
    ops, counts = np.unique(tasks.records[:, 0], return_counts=True)
    assert {T.op_name(int(o)): int(c) for o, c in zip(ops, counts)} == {k: v["count"] for k, v in s["per_op"].items()}
    assert s["n_tasks"] == len(tasks.records)
    assert abs(s["step_us"] * 1e3 - tl.step_ns) < 1
    for d in s["per_op"].values():      # busy time splits into its parts
        assert abs(d["busy"] - (d["dep_wait"] + d["load_wait"] + d["compute"])) < 1e-6 * max(1.0, d["busy"])
    assert s["per_op"]["QKV"]["bytes"] == float(raw.task_bytes[tasks.records[:, 0] == O.Op.QKV].sum()) > 0
    # the critical path is a dependency chain that ends with the step's last task
    path = T.critical_path(tl)
    assert path[-1] == int(np.argmax(tl.tasks.end)) and len(path) >= tasks.records[-1, O.R["layer"]]
    prod = T.producers(tasks.records)
    for a, b in zip(path, path[1:]):
        waits = [int(tasks.records[b, O.R[f"w{k}c"]]) for k in range(O.MAX_WAITS)]
        assert any(a in prod.get(c, ()) for c in waits if c >= 0)
    text = T.format_summary(s)
    assert "critical path" in text and "QKV" in text and "idle tail" in text


def test_trace_and_png_render(emulated, tmp_path):
    raw, tl, tasks = emulated
    path = tmp_path / "step.json"
    T.write_trace(tl, str(path))
    doc = json.loads(path.read_text())
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    tops = [e for e in slices if not e["name"].startswith(("wait:", "epilogue + signal"))]   # nested parts aside
    assert len(tops) == len(tasks.records)
    assert {e["tid"] for e in slices} <= set(range(8))
    assert all(e["dur"] >= 0 for e in slices)
    png = tmp_path / "step.png"
    T.plot_timeline(tl, str(png))
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    T.save_raw(raw, str(tmp_path / "raw.npz"))
    back = T.load_raw(str(tmp_path / "raw.npz"))
    assert np.array_equal(back.tasks, raw.tasks) and back.item_bytes == raw.item_bytes
    assert T.summarize(T.to_timeline(back))["step_us"] == T.summarize(tl)["step_us"]


def test_epilogue_is_split_from_compute_and_old_records_still_map(emulated):
    """The `computed` stamp splits each task's compute into the GEMV core and its epilogue + signal; records
    written before that stamp existed (one column fewer) read with computed = end."""
    raw, tl, _ = emulated
    s = T.summarize(tl)
    for d in s["per_op"].values():
        assert 0 < d["epilogue"] < d["compute"]
    assert "epilogue" in T.format_summary(s)
    before_marks = raw.tasks[:, :O.PROF_INTS - len(O.PROF_MARK_FIELDS)]
    old = T.RawProfile(np.delete(before_marks, T.F["computed"], axis=1), raw.items, raw.blocks, raw.records,
                       raw.task_bytes, raw.item_bytes)
    tl_old = T.to_timeline(old)
    assert np.array_equal(tl_old.tasks.computed, tl_old.tasks.end)
    assert T.check_invariants(old, tl_old) == []
    late = raw.tasks.copy()
    late[4, T.F["computed"]] = late[4, T.F["end"]] + 1000           # the GEMV core after the task's end
    broken = T.RawProfile(late, raw.items, raw.blocks, raw.records, raw.task_bytes, raw.item_bytes)
    assert any("out of order" in v for v in T.check_invariants(broken, T.to_timeline(broken)))


def test_phase_marks_read_in_time_order_and_old_records_have_none(emulated):
    """Marks inside a task kind's work (opcodes.PROF_MARKS) come out per kind as mean us after the claim, in time
    order, next to the stamps; records from before the marks (four columns fewer) map with none taken."""
    raw, tl, _ = emulated
    s = T.summarize(tl)
    assert set(s["phases"]) == {n for n in O.PROF_MARKS if n in s["per_op"]} and "NORM" in s["phases"]
    at = s["phases"]["NORM"]
    label = O.PROF_MARKS["NORM"][0]
    assert list(at.values()) == sorted(at.values())
    assert at["waited"] <= at[label] <= at["end"]           # the emulator marks halfway through the work
    assert "phases of NORM" in T.format_summary(s)
    norm = np.flatnonzero(raw.records[:, O.R["op"]] == O.Op.NORM)
    assert np.isfinite(tl.tasks.marks[norm, 0]).all() and np.isnan(tl.tasks.marks[norm, 1:]).all()
    old = T.RawProfile(raw.tasks[:, :O.PROF_INTS - len(O.PROF_MARK_FIELDS)], raw.items, raw.blocks, raw.records,
                       raw.task_bytes, raw.item_bytes)
    tl_old = T.to_timeline(old)
    assert np.isnan(tl_old.tasks.marks).all() and T.summarize(tl_old)["phases"] == {}
    assert T.check_invariants(old, tl_old) == []


def test_critical_chain_follows_data_or_the_block(emulated):
    """The summary's critical path (`critical_chain`) ends with the step's last event, and every step back goes to a
    producer of a counter the task waited on or to the task before it on its block; its per-opcode times add up to
    the step."""
    raw, tl, tasks = emulated
    chain = T.critical_chain(tl)
    t = tl.tasks
    assert chain[-1] == ("t", int(np.argmax(t.end)))
    prod = T.producers(tasks.records)
    for (ka, a), (kb, b) in zip(chain, chain[1:]):
        assert ka == kb == "t"
        waits = [int(tasks.records[b, O.R[f"w{k}c"]]) for k in range(O.MAX_WAITS)]
        data = any(a in prod.get(c, ()) for c in waits if c >= 0)
        same_block = t.block[a] == t.block[b] and t.end[a] <= t.claim[b] + 1
        assert data or same_block
    s = T.summarize(tl)
    assert abs(sum(s["critical_path"]["by_op"].values()) - s["critical_path"]["us"]) < 0.05
    assert abs(s["critical_path"]["us"] * 1e3 - t.end.max()) < 1


def test_layer_events_read_a_typical_layer(emulated):
    """layer_events: per task kind of a layer, the medians of its first claim, first wait end, first and last end
    after the layer's NORM; each kind's first end precedes its last, and the next NORM ends after every kind of the
    layer it waits on (its attention and MLP outputs)."""
    raw, tl, tasks = emulated
    ev = T.layer_events(tl)
    assert {"QKV", "ATTN", "ATTN_COMBINE", "OPROJ", "next NORM"} <= set(ev), sorted(ev)
    for name, v in ev.items():
        assert v["first_end"] <= v["last_end"], (name, v)
        assert v["first_claim"] <= v["first_waited"] + 1e-6, (name, v)
    assert ev["QKV"]["last_end"] > 0 and ev["next NORM"]["last_end"] >= ev["OPROJ"]["last_end"]
    s = T.summarize(tl)
    assert s["layer_events"] == ev and "a layer (medians" in T.format_summary(s)


def test_layer_events_of_fused_norm_steps():
    """Where the tiles normalise their own rows (fused_norm: no NORM task past layer 0), a layer starts when the
    first of its QKV / router tiles stops waiting: every kind of the layer ends after that start, and the next
    layer's inputs are complete after the layer's O projection and MoE items end."""
    cfg = make_cfg("north_like")
    w = tiny_weights(cfg)
    st = prefill_state(cfg, w, [13], chunk=16)
    batch = decode_batch(st, [5])
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=8, split_tokens=8, fused_norm=1)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    tasks = build_tasks(plan, si.B, si.nsplit)
    nbytes, _ = T.task_bytes(plan, si, tasks.records)
    tl = T.to_timeline(T.emulate(tasks.records, nbytes, n_blocks=8))
    assert int((tl.tasks.op == O.Op.NORM).sum()) == 2              # layer 0's and the final norm
    ev = T.layer_events(tl)
    assert {"QKV", "ROUTER", "ATTN", "next layer's inputs"} <= set(ev), sorted(ev)
    for name, v in ev.items():
        assert v["last_end"] >= 0 and v["first_end"] <= v["last_end"], (name, v)
    nxt = ev["next layer's inputs"]["last_end"]
    assert all(v["last_end"] <= nxt + 1e-6 for k, v in ev.items() if k in ("OPROJ_ITEM", "OPROJ", "MOE_DOWN")), ev


def _events(block, op, layer, end) -> T.Events:
    n = len(block)
    z = np.zeros(n)
    a = lambda v: np.asarray(v, dtype=np.int64)   # noqa: E731
    e = np.asarray(end, dtype=np.float64)
    return T.Events(a(block), a(block), a(op), a(layer), a(np.arange(n)), z, z, z, z, e, e, z)


def test_moe_worker_tails_read_each_workers_own_items():
    """Three workers of layer 0 (blocks 0, 1, 2) ending at 10, 20 and 9 us; block 0 ran items ending at 5 and 8 us,
    block 1 one ending at 19, block 2 none; a layer-1 worker of block 0 whose items are layer 1's, not layer 0's:
    tails 2 / 1 / 3 us, one idle worker, and the layers' last workers 1 and 3 us after their last items."""
    W, GU = int(O.Op.MOE_WORKER), O.PROF_ITEM_GU
    tasks = _events([0, 1, 2, 0], [W, W, W, W], [0, 0, 0, 1], [10_000, 20_000, 9_000, 40_000])
    items = _events([0, 0, 1, 0], [GU] * 4, [0, 0, 0, 1], [5_000, 8_000, 19_000, 37_000])
    tl = T.Timeline(tasks, items, 3, 32.0, np.zeros(3), np.zeros((0, O.REC_INTS), np.int32), {}, {})
    m = T.moe_worker_tails(tl)
    assert m["tail_after_own_last_item_us"] == dict(median=2.0, p90=2.8, max=3.0)
    assert m["idle_workers"] == 1 and m["items_per_worker"] == dict(mean=1.0, max=2)
    assert m["last_worker_after_layer_items_us"] == dict(median=2.0, p90=2.8, max=3.0)
    # without item records (the emulator's) there is nothing to say
    assert T.moe_worker_tails(T.Timeline(tasks, _events([], [], [], []), 3, 32.0, np.zeros(3),
                                         np.zeros((0, O.REC_INTS), np.int32), {}, {})) == {}
