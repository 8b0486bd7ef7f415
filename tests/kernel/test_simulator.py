"""The CPU simulator runs the megakernel's task list in random dependency-respecting orders and must match the
PyTorch decode step within fp32 tolerance (1e-5 relative) on tiny configs; a removed dependency edge must be
caught as a read before write."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kernel_helpers import VARIANTS, clone_cache, decode_batch, make_cfg, prefill_state, tiny_weights
from megakernel.kernel import opcodes as O
from megakernel.kernel.plan import ModelPlan
from megakernel.kernel.schedule import build_tasks, qkv_tiles, step_inputs, validate
from megakernel.kernel.simulator import ReadBeforeWrite, SimDeadlock, Simulator
from megakernel.model.cohere2_moe import Cohere2MoeModel, ForwardTrace

torch.set_num_threads(1)

_STATE_CACHE: dict = {}


def _setup(variant: str, B: int, seed: int):
    cfg = make_cfg(variant)
    w = tiny_weights(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed * 31 + B)
    lens = torch.randint(1, 40, (B,), generator=g).tolist()     # ragged, most cross the window (8)
    st = prefill_state(cfg, w, lens, seed=seed, chunk=16)
    nxt = torch.randint(3, cfg.vocab_size, (B,), generator=g).tolist()
    return cfg, w, st, nxt


def _check_step(cfg, w, st, nxt, plan, seeds, steps=1, claims_held=1, sim: Simulator | None = None):
    model = Cohere2MoeModel(cfg, w)
    c_sim = clone_cache(st.cache)
    sim = sim or Simulator(plan, w, claims_held=claims_held)
    for step in range(steps):
        batch = decode_batch(st, nxt)
        tr = ForwardTrace()
        ref = model.forward(batch, st.cache, tr)
        si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
        tl = build_tasks(plan, si.B, si.nsplit)
        validate(tl)
        for k, seed in enumerate(seeds):
            cache = c_sim if k == len(seeds) - 1 else clone_cache(c_sim)
            res = sim.step(si, tl, cache, seed=seed)
            err = float((res.logits - ref).abs().max() / ref.abs().max())
            assert err < 1e-5, (step, seed, err)
            assert torch.equal(res.tokens.long(), res.logits.argmax(-1))
            for a, b in zip(res.experts, tr.experts):
                assert torch.equal(a.sort(-1).values, b.sort(-1).values)
        for a, b in zip(c_sim.kv, st.cache.kv):
            assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
        nxt = ref.argmax(-1).tolist()
        for i in range(len(nxt)):
            st.tokens[i].append(nxt[i])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("B", [1, 2, 5, 16])
def test_simulator_matches_torch(variant, B):
    cfg, w, st, nxt = _setup(variant, B, seed=B)
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=3, split_tokens=3 + B % 3)
    _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 100])


@pytest.mark.parametrize("B", [3, 7, 11])
def test_simulator_several_steps_and_default_split(B):
    """Several decode steps (windows crossed, sliding blocks recycled), one split per head, max_batch < 16."""
    cfg, w, st, nxt = _setup("north_like", B, seed=7)
    plan = ModelPlan(cfg, st.layout, max_batch=B + 1, n_workers=2)
    _check_step(cfg, w, st, nxt, plan, seeds=[1], steps=3)


def _records_by_layer(cfg, st, nxt, plan):
    """The step's task records, its MoE layers (at least one), and where op's records of layer l sit in the list."""
    batch = decode_batch(st, nxt)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    rec = build_tasks(plan, si.B, si.nsplit).records
    moe_layers = [l for l in range(cfg.num_layers) if cfg.is_moe(l)]
    assert moe_layers
    return rec, moe_layers, lambda op, l: np.nonzero((rec[:, 0] == int(op)) & (rec[:, 1] == l))[0]


@pytest.mark.parametrize("B", [1, 5])
def test_simulator_with_oproj_listed_before_the_workers(B):
    """The `oproj_first` and `qkv_by_head` orderings (measurement knobs) keep the list topological and the step
    exact."""
    cfg, w, st, nxt = _setup("north_like", B, seed=B)
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=1 + B, split_tokens=4, oproj_first=1, qkv_by_head=1)
    rec, moe_layers, at = _records_by_layer(cfg, st, nxt, plan)
    for l in moe_layers:
        assert at(O.Op.OPROJ, l)[0] < at(O.Op.MOE_WORKER, l)[0], f"layer {l}: O projection not ahead of the workers"
    qkv = rec[(rec[:, 0] == int(O.Op.QKV)) & (rec[:, 1] == 0)]
    sig = qkv[:, O.R["sig"]]
    assert (np.diff(sig) >= 0).all() and len(set(sig.tolist())) == cfg.num_kv_heads, sig   # head by head
    _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 7])


@pytest.mark.parametrize("B", [1, 2, 5])
def test_simulator_with_oproj_among_the_workers(B):
    """`o_workers_after` (`o_workers_after_2row` for plans of at most two rows): a MoE layer's static O tiles listed
    ahead of that many of its workers and after the rest; the list stays topological and the step exact under random
    claim orders. 0 puts every worker first; at least n_workers puts the O tiles first."""
    cfg, w, st, nxt = _setup("north_like", B, seed=B + 3)
    for late, late_2row in ((1, 3), (3, 1), (0, 0)):
        plan = ModelPlan(cfg, st.layout, max_batch=16, tile_batch=B, n_workers=3, split_tokens=4, o_queue=0,
                         o_workers_after=late, o_workers_after_2row=late_2row)
        n_after = late_2row if B <= 2 else late
        _, moe_layers, at = _records_by_layer(cfg, st, nxt, plan)
        for l in moe_layers:
            workers, oproj = at(O.Op.MOE_WORKER, l), at(O.Op.OPROJ, l)
            assert len(workers) == 3 and len(oproj) > 0
            assert sum(i > oproj[-1] for i in workers) == n_after, f"layer {l}: {workers} / {oproj}"
            assert all(not oproj[0] < i < oproj[-1] for i in workers), f"layer {l}: a worker among the O tiles"
        _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 11])


def _find(tl, op):
    return [i for i in range(len(tl.records)) if int(tl.records[i, 0]) == int(op)]


@pytest.mark.parametrize("op", [O.Op.OPROJ, O.Op.ATTN, O.Op.ATTN_COMBINE, O.Op.NORM, O.Op.LM_HEAD,
                                O.Op.MLP_DOWN, O.Op.TOPK, O.Op.MOE_WORKER])
def test_missing_edge_is_caught(op):
    """Dropping the wait of one task must make some random order read an unwritten buffer."""
    cfg, w, st, nxt = _setup("north_like", 3, seed=3)
    plan = ModelPlan(cfg, st.layout, max_batch=4, n_workers=2, split_tokens=4)
    batch = decode_batch(st, nxt)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    tl = build_tasks(plan, si.B, si.nsplit)
    idx = [i for i in _find(tl, op) if int(tl.records[i, O.R["w0c"]]) >= 0]
    victim = idx[len(idx) // 2]
    tl.records = tl.records.copy()
    tl.records[victim, O.R["w0c"]:O.R["w2t"] + 1] = -1
    with pytest.raises((ReadBeforeWrite, SimDeadlock)):
        sim = Simulator(plan, w)
        for seed in range(40):
            sim.step(si, tl, clone_cache(st.cache), seed=seed)


def test_wrong_target_deadlocks():
    cfg, w, st, nxt = _setup("north_like", 2, seed=4)
    plan = ModelPlan(cfg, st.layout, max_batch=2, n_workers=2)
    batch = decode_batch(st, nxt)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    tl = build_tasks(plan, si.B, si.nsplit)
    i = _find(tl, O.Op.OPROJ)[0]
    tl.records = tl.records.copy()
    tl.records[i, O.R["w0t"]] += 1
    with pytest.raises(AssertionError):
        validate(tl)
    with pytest.raises(SimDeadlock, match="combines"):
        Simulator(plan, w).step(si, tl, clone_cache(st.cache), seed=0)


def test_validate_rejects_forward_edge():
    cfg, w, st, nxt = _setup("north_like", 2, seed=5)
    plan = ModelPlan(cfg, st.layout, max_batch=2, n_workers=2)
    tl = build_tasks(plan, 2, np.ones((2, plan.n_groups), dtype=np.int32))
    validate(tl)
    rec = tl.records.copy()
    q = _find(tl, O.Op.QKV)[0]
    o = _find(tl, O.Op.OPROJ)[-1]
    rec[q, O.R["w1c"]] = rec[o, O.R["sig"]]            # QKV of layer 0 waiting on the last o-proj
    rec[q, O.R["w1t"]] = 1
    tl.records = rec
    with pytest.raises(AssertionError, match="later task"):
        validate(tl)


def test_north_task_list_shape():
    """The real model's task list: every wait on an earlier producer; counts of each task kind."""
    from megakernel.config import north_mini_code_config
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)
    plan = ModelPlan(cfg, layout, max_batch=16, n_workers=132)
    plan.check_supported()
    assert plan.smem_bytes() <= O.SMEM_LIMIT
    tables = [[list(range(200)), list(range(200))] for _ in range(16)]
    si = step_inputs(plan, [5] * 16, [8191 - i for i in range(16)], tables)
    # 16 rows >= wider_split_batch: 2048-key splits (full 8K / 2048, sliding 4096 / 2048); 8 rows >=
    # wide_split_batch: 1024; one row: 512-key splits
    assert si.split_tokens == 4 * O.DEFAULT_SPLIT_TOKENS == 2048
    assert si.nsplit[:, 0].max() == 4 and si.nsplit[:, 1].max() == 2
    eight = step_inputs(plan, [5] * 8, [8191 - i for i in range(8)], tables[:8])
    assert eight.split_tokens == 1024 and eight.nsplit[:, 0].max() == 8 and eight.nsplit[:, 1].max() == 4
    one = step_inputs(plan, [5], [8191], tables[:1])
    assert one.split_tokens == 512 and one.nsplit[0, 0] == 16 and one.nsplit[0, 1] == 8
    # one row of a short context (short_splits=4): its longest range (1024 keys) in 4 splits of 256; from 2048 keys
    # the default 512; two rows keep 512 at any length
    short = step_inputs(plan, [5], [1023], tables[:1])
    assert short.split_tokens == 256 and short.nsplit[0].max() == 4
    assert step_inputs(plan, [5], [1499], tables[:1]).split_tokens == 384
    assert step_inputs(plan, [5], [2047], tables[:1]).split_tokens == 512
    assert step_inputs(plan, [5, 5], [1023, 1023], tables[:2]).split_tokens == 512
    assert step_inputs(plan, [5], [199], tables[:1]).split_tokens == 256      # never below MIN_SHORT_SPLIT
    # a split whose KV blocks the attention's shared-memory table cannot hold is refused with a clear error
    small = KVLayout.for_model(cfg, 4)
    tiny_blocks = ModelPlan(cfg, small, max_batch=1, n_workers=132, split_tokens=4 * O.ATTN_TABLE_SLOTS)
    with pytest.raises(ValueError, match="larger KV blocks"):
        step_inputs(tiny_blocks, [5], [8191], [[list(range(2048)), list(range(2048))]])
    # 16 rows over 4-token blocks: 2048-key splits would span 514 blocks (> ATTN_TABLE_SLOTS), so the wide 1024 stays
    small16 = ModelPlan(cfg, small, max_batch=16, n_workers=132)
    wide = step_inputs(small16, [5] * 16, [8191] * 16, [[list(range(2048)), list(range(2048))]] * 16)
    assert wide.split_tokens == 1024
    tl = build_tasks(plan, si.B, si.nsplit)
    validate(tl)
    ops = np.bincount(tl.records[:, 0], minlength=13)
    assert ops[O.Op.QKV] == 49 * len(qkv_tiles(32 * 128, 4 * 128, 128, 8, plan.qkv_rows)[0])
    assert ops[O.Op.MOE_WORKER] == 48 * 132
    assert ops[O.Op.LM_HEAD] == plan.n_lm_tiles


def test_long_context_split_sizes_and_their_alignment():
    """Past MAX_SPLITS_PER_HEAD default splits a split grows to cover the range in at most that many: rounded up to 64
    keys (576 at 128K, 1088 at 256K: half an attention chunk at the end) or to split_align's default 128 (whole
    ATTN_CHUNKs, 640 and 1152); the count never exceeds the cap, and a bad alignment is refused."""
    from megakernel.config import north_mini_code_config
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)
    plain = ModelPlan(cfg, layout, max_batch=16, n_workers=132, split_align=64, split_waves=0)
    whole = ModelPlan(cfg, layout, max_batch=16, n_workers=132, split_waves=0)
    for ctx, s64, s128 in ((131072 + 50, 576, 640), (262144 + 50, 1088, 1152), (8192, 512, 512)):
        assert plain.split_size(ctx) == s64 and whole.split_size(ctx) == s128
        assert math.ceil(ctx / s128) <= O.MAX_SPLITS_PER_HEAD and s128 % O.ATTN_CHUNK == 0
    assert whole.split_size(1023) == plain.split_size(1023) == 256           # short_splits is not aligned by it
    with pytest.raises(ValueError, match="split_align"):
        ModelPlan(cfg, layout, max_batch=16, n_workers=132, split_align=96).check_supported()
    # split_waves (the default): the multiple of 128 up to WAVE_SPLIT_MAX whose full layer takes the fewest
    # key-waves over the blocks (128K: 820 splits of 640 keys are 7 waves of 132, 516 of 1024 keys 4); past
    # WAVE_SPLIT_MAX the smallest (256K: 1152; 229K: 1024, where 1408 had fewer key-waves and measured no faster);
    # the count cap holds; short contexts and fixed sizes keep theirs
    waves = ModelPlan(cfg, layout, max_batch=16, n_workers=132, split_waves=1)
    assert ModelPlan.split_waves == 1
    for ctx, want in ((131072 + 50, 1024), (163840 + 50, 1024), (196608 + 50, 1024), (229376 + 50, 1024),
                      (262144 + 50, 1152), (8192, 512), (1023, 256)):
        assert waves.split_size(ctx) == want, ctx
        assert math.ceil(ctx / want) <= O.MAX_SPLITS_PER_HEAD
    assert waves.split_size(131072 + 50, 2) == 896                     # 2 rows: 1176 splits, 9 waves of 896 keys
    assert waves.split_size(131072 + 50, 2, [131072 + 50, 1000]) == 1024   # the short row adds 4 splits, not 820
    assert ModelPlan(cfg, layout, max_batch=16, n_workers=132, split_waves=1, split_tokens=640).split_size(
        131072 + 50) == 640


def test_task_list_builder_fills_only_the_attention_splits():
    """One TaskListBuilder serves every split count of its batch size: each list validates, its attention splits and
    combines follow that step's nsplit, its partial slots are numbered densely, and everything else is the same
    records in the same places relative to the layers' attention blocks."""
    from megakernel.config import north_mini_code_config
    from megakernel.kernel.schedule import TaskListBuilder
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    plan = ModelPlan(cfg, KVLayout.for_model(cfg, 64), max_batch=4, n_workers=132, combine_parts=2)
    builder = TaskListBuilder(plan, 3)
    rng = np.random.default_rng(5)
    rest = None
    for _ in range(4):
        ns = rng.integers(1, 30, size=(3, plan.n_groups)).astype(np.int32)
        tl = builder.build(ns)
        validate(tl)
        rec = tl.records
        att = rec[:, O.R["op"]] == O.Op.ATTN
        comb = rec[:, O.R["op"]] == O.Op.ATTN_COMBINE
        per_layer = [int(ns[:, plan.layout.locate(l)[0]].sum()) * plan.nkv for l in range(plan.L)]
        assert np.bincount(rec[att, O.R["layer"]], minlength=plan.L).tolist() == per_layer
        assert comb.sum() == plan.L * 3 * plan.nkv * 2 and tl.n_partials == sum(per_layer)
        assert sorted(rec[att, O.R["a3"]] + rec[att, O.R["a2"]]) == list(range(tl.n_partials))
        others = rec[~(att | comb)]
        if rest is not None:
            assert np.array_equal(others, rest)
        rest = others
        assert tl.records.tobytes() == build_tasks(plan, 3, ns).records.tobytes()


def test_step_inputs_refuse_recycled_block():
    cfg = make_cfg("north_like")
    from megakernel.kv.cache import KVLayout
    layout = KVLayout.for_model(cfg, 4)
    plan = ModelPlan(cfg, layout, max_batch=2)
    with pytest.raises(ValueError, match="recycled"):
        step_inputs(plan, [3], [20], [[list(range(6)), [-1, -1, -1, -1, 7, 8]]])
    with pytest.raises(ValueError, match="does not cover"):
        step_inputs(plan, [3], [20], [[list(range(5)), list(range(5))]])
    with pytest.raises(ValueError, match="1..2"):
        step_inputs(plan, [3, 4, 5], [1, 1, 1], [[[0], [0]]] * 3)


def test_header_is_generated_from_opcodes():
    h = O.generate_header()
    for op in O.Op:
        assert f"#define OP_{op.name} {int(op)}" in h
    for i, f in enumerate(O.PARAM_FIELDS):
        assert f"#define PRM_{f} {i}" in h
    assert f"#define MK_REC_INTS {O.REC_INTS}" in h
    # the CUDA sources use no literal opcode numbers: every OP_ name they mention exists in the header
    import re
    from megakernel.kernel.build import source_texts
    src = "\n".join(source_texts().values())          # every CUDA source (the generated header too)
    for name in set(re.findall(r"\bOP_([A-Z_]+)", src)):
        assert name in O.Op.__members__, name
    for name in set(re.findall(r"PRM_##name|P[ILPF]\(([a-z_0-9]+)\)", src)) - {"", "name"}:   # "name": the macros
        assert name in O.P, name


def test_torch_path_records_router_logits():
    """ForwardTrace(router_logits=[]) gets each MoE layer's router logits from the PyTorch path (the backends'
    tests judge near ties on them too): one [rows, experts] tensor per MoE layer whose top-k are the traced experts."""
    cfg, w, st, nxt = _setup("north_like", 3, seed=3)
    tr = ForwardTrace(router_logits=[])
    Cohere2MoeModel(cfg, w).forward(decode_batch(st, nxt), clone_cache(st.cache), tr)
    assert len(tr.router_logits) == len(tr.experts) == sum(cfg.is_moe(l) for l in range(cfg.num_layers))
    for lg, ex in zip(tr.router_logits, tr.experts):
        assert lg.shape == (3, cfg.num_experts)
        top = lg.topk(cfg.num_experts_per_tok, dim=-1).indices
        assert torch.equal(top.sort(-1).values, ex.sort(-1).values)


def test_per_batch_tilings_on_north_dims():
    """batch_tiles without prefetching: at North dims, launches of <= 9 rows get 128 KB O-projection tiles (the
    inputs of 16 rows of 4096, padded rows and the tensor-core GEMV's scratch leave room for 64 KB only); every plan
    fits the shared memory and needs no more scratch than the full one. With o_queue=N, launches of <= N rows have
    a plan of their own, the same tiles with the O-projection tiles in the expert queues. (Power-of-two tiles,
    tile_kb=0; the default tile_kb's: test_tile_kb_tilings_on_north_dims.)"""
    from megakernel.config import north_mini_code_config
    from megakernel.kernel.plan import plan_for_rows, tiling_plans
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)
    # (static O tiles everywhere: one place among the workers for every plan, so the tilings alone split plans)
    one_order = dict(o_workers_after_2row=ModelPlan.o_workers_after)
    paged = tiling_plans(cfg, layout, 16, True, n_workers=132, prefetch=0, o_queue=0, tile_kb=0, moe_pages=8,
                         moe_pages_from=2, slot_pairs=0, **one_order)
    assert [(p.tb, p.pg_rows) for p in paged] == [(8, 8), (9, 0), (16, 0)]     # (the 2..8-row launches paged)
    assert [plan_for_rows(paged, b).tb for b in range(1, 17)] == [9] + [8] * 7 + [9] + [16] * 7
    every = tiling_plans(cfg, layout, 16, True, n_workers=132, prefetch=0, o_queue=0, tile_kb=0, moe_pages=8,
                         moe_pages_from=1, slot_pairs=0, **one_order)                       # (one row paged too)
    # (one row: a paged plan of its own, its items of moe_pages_tile_kb_1row; 2..8 rows the 8-row plan's)
    assert [plan_for_rows(every, b).tb for b in range(1, 17)] == [1] + [8] * 7 + [9] + [16] * 7
    assert every[0].tb == 1 and every[0].pg_n and every[0].gu_rows < every[1].gu_rows
    five = tiling_plans(cfg, layout, 16, True, n_workers=132, prefetch=0, o_queue=0, tile_kb=0, moe_pages=8,
                        moe_pages_from=5, slot_pairs=0, **one_order)                        # (the 1..4-row launches plain)
    assert [plan_for_rows(five, b).tb for b in range(1, 17)] == [9] * 4 + [8] * 4 + [9] + [16] * 7
    # with the O tiles of <= 2-row launches placed apart (o_workers_after_2row, the default), those get a plan of
    # their own: the 2-row tiling, its O tiles ahead of more workers
    two = tiling_plans(cfg, layout, 16, True, n_workers=132, prefetch=0, o_queue=0, tile_kb=0, moe_pages=0)
    assert [(p.tb, p.o_late_workers) for p in two] == [(2, 48), (9, 16), (16, 16)]
    assert [plan_for_rows(two, b).tb for b in range(1, 17)] == [2] * 2 + [9] * 7 + [16] * 7
    plans = tiling_plans(cfg, layout, 16, True, n_workers=132, prefetch=0, o_queue=0, tile_kb=0, moe_pages=0,
                         **one_order)
    assert [p.tb for p in plans] == [9, 16]
    assert (plans[0].o_rows, plans[1].o_rows) == (16, 8)
    assert plan_for_rows(plans, 1) is plans[0] and plan_for_rows(plans, 9) is plans[0]
    assert plan_for_rows(plans, 10) is plans[1]
    assert all(p.o_items == 0 for p in plans)
    for o_queue in (1, 4):
        plans = tiling_plans(cfg, layout, 16, True, n_workers=132, prefetch=0, o_queue=o_queue, tile_kb=0,
                             moe_pages=0, **one_order)
        assert [p.tb for p in plans] == [o_queue, 9, 16]
        assert [p.o_rows for p in plans] == [16, 16, 8]
        assert [p.o_items for p in plans] == [plans[0].n_o_tiles, 0, 0] and plans[0].n_o_tiles > 0
        assert plan_for_rows(plans, 1) is plans[0] and plan_for_rows(plans, o_queue) is plans[0]
        assert plan_for_rows(plans, o_queue + 1) is plans[1]
    for p in plans:
        assert p.wbuf == 0
        assert p.smem_bytes() <= O.SMEM_LIMIT
        assert p.n_lm_tiles <= plans[-1].n_lm_tiles and p.gu_tiles <= plans[-1].gu_tiles
    assert tiling_plans(cfg, KVLayout.for_model(cfg, 64), 16, False, prefetch=0, tile_kb=0)[0].tb == 16


def test_prefetching_tilings_on_north_dims():
    """Prefetching plans (prefetch=1): launches of 1, 2, 4 and 8 rows get two weight buffers, each tile filling
    one, the inputs after both; 16 rows of 4096 inputs leave no room for two buffers of PREFETCH_MIN_TILE, so that
    plan keeps one buffer. Every plan fits the shared memory with the static part reserved, every tile fits its
    buffer, a QKV tile stays inside one head, and the small task kinds stay clear of buffer 1."""
    from megakernel.config import north_mini_code_config
    from megakernel.kernel.plan import small_task_smem_bytes, tiling_plans
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    plans = tiling_plans(cfg, KVLayout.for_model(cfg, 64), 16, True, n_workers=132, prefetch=1)
    assert [p.tb for p in plans] == [1, 2, 4, 8, 16]
    assert [p.wbuf > 0 for p in plans] == [True, True, True, True, False]
    for p in plans:
        assert p.smem_bytes() <= O.SMEM_LIMIT - (O.SMEM_RESERVE if p.wbuf else 0)
        if p.wbuf:
            assert p.wbuf >= O.PREFETCH_MIN_TILE
            assert all((K + O.ROW_PAD) * rows * 2 <= p.wbuf for K, rows in p.gemv_tiles)
            assert small_task_smem_bytes(p.E, p.H) <= O.GEMV_SCRATCH_BYTES + p.wbuf
            assert p.qkv_rows % 2 == 0 and (p.d % p.qkv_rows == 0 or p.tb <= p.qkv_fill_rows)
    b1 = plans[0]
    assert b1.wbuf >= 96 * 1024 and b1.gu_rows * 2 * b1.H * 2 >= 96 * 1024      # ~98 KB tiles at batch 1
    # the smaller tiles of the prefetching plans need more LM-head maxima than the full plan: the backend sizes the
    # scratch from the max over its plans
    need = max(p.n_lm_tiles for p in plans)
    assert need > plans[-1].n_lm_tiles
    assert plans[-1].scratch_spec(torch.bfloat16, n_lm_tiles=need)["lm_best"][0][0] == need


@pytest.mark.parametrize("B", [1, 3])
def test_simulator_with_a_smaller_tile_batch(B):
    """A plan whose tiles leave room for fewer rows than max_batch runs a step of that many rows exactly."""
    cfg, w, st, nxt = _setup("north_like", B, seed=11 + B)
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4, tile_batch=B)
    _check_step(cfg, w, st, nxt, plan, seeds=[B])


@pytest.mark.parametrize("variant", ["softmax_2dense_bias", "softmax_shared_avg_untied_g4"])
@pytest.mark.parametrize("rows", [6, 10, 12])
@pytest.mark.parametrize("B", [1, 3])
def test_simulator_with_qkv_tiles_across_heads(variant, rows, B):
    """QKV tiles whose rows do not divide head_dim (qkv_fill_rows: 48 or 40 at North dims): Q tiles that start
    inside a query head and span two, K / V tiles cut unevenly inside a head. The rows are set on the plan here
    (the tiny dims' tile budget gives 64), which sizes nothing else; the step stays exact in random orders."""
    cfg, w, st, nxt = _setup(variant, B, seed=rows + B)
    plan = ModelPlan(cfg, st.layout, max_batch=4, n_workers=3, split_tokens=4)
    plan.qkv_rows = rows
    r0, nr = qkv_tiles(plan.Q, plan.KV, plan.d, plan.g, rows)
    assert (r0 % plan.d != 0).any() and (nr < rows).any()
    _check_step(cfg, w, st, nxt, plan, seeds=[rows, rows + 5])


def test_qkv_late_weights_flags_the_small_plans_qkv_tiles():
    """qkv_late_weights: the QKV records of plans of at most that many rows carry FLAG_LATE_WEIGHTS (nothing else
    does, and the knob at 0 leaves the lists as they were); the step stays exact in random orders (the flag only
    moves when a tile's weights are issued, which the simulator does not model)."""
    cfg, w, st, nxt = _setup("north_like", 1, seed=71)
    lists = {}
    for knob in (0, 1):
        plan = ModelPlan(cfg, st.layout, max_batch=1, n_workers=3, split_tokens=4, qkv_late_weights=knob)
        tl = build_tasks(plan, 1, np.full((1, plan.n_groups), 2))
        lists[knob] = tl.records
        late = (tl.records[:, O.R["flags"]] & O.FLAG_LATE_WEIGHTS) != 0
        assert np.array_equal(late, (tl.records[:, 0] == O.Op.QKV) & bool(knob))
    on = lists[1].copy()
    on[:, O.R["flags"]] &= ~O.FLAG_LATE_WEIGHTS
    assert np.array_equal(on, lists[0])
    wide = ModelPlan(cfg, st.layout, max_batch=4, tile_batch=4, n_workers=3, split_tokens=4, qkv_late_weights=1)
    tl = build_tasks(wide, 4, np.full((4, wide.n_groups), 2))
    assert not (tl.records[:, O.R["flags"]] & O.FLAG_LATE_WEIGHTS).any()
    _check_step(cfg, w, st, nxt, ModelPlan(cfg, st.layout, max_batch=1, n_workers=3, split_tokens=4,
                                           qkv_late_weights=1), seeds=[3, 8])


def test_tile_kb_tilings_on_north_dims():
    """tile_kb=192 at North dims: the launches of one row get 192 KB gate/up tiles (24 rows per half, no power of
    two) and O-projection tiles (24 rows of 4096), 48-row QKV tiles (qkv_fill_rows: 112 tiles, none across two kv
    heads; 32 rows, dividing head_dim, with qkv_fill_rows=0) and 64-row down tiles (MAX_TILE_ROWS); launches of 16
    rows keep the default tiles (their inputs leave no room)."""
    from megakernel.config import north_mini_code_config
    from megakernel.kernel.plan import plan_for_rows, tiling_plans
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)
    plans = tiling_plans(cfg, layout, 16, True, n_workers=132, tile_kb=192, moe_pages_from=2)   # (one row plain)
    default = tiling_plans(cfg, layout, 16, True, n_workers=132)
    one = plan_for_rows(plans, 1)
    assert (one.gu_rows, one.o_rows, one.qkv_rows, one.dn_rows) == (24, 24, 48, 64)
    tl = build_tasks(one, 1, np.full((1, one.n_groups), 4))
    qkv = tl.records[(tl.records[:, 0] == O.Op.QKV) & (tl.records[:, 1] == 1)]
    assert len(qkv) == 112 and set(qkv[:, 3].tolist()) == {40, 48} and qkv[:, 3].sum() == 4096 + 2 * 512
    whole = plan_for_rows(tiling_plans(cfg, layout, 16, True, n_workers=132, tile_kb=192, moe_pages_from=2,
                                       qkv_fill_rows=0), 1)
    assert whole.qkv_rows == 32 and (whole.gu_rows, whole.o_rows) == (one.gu_rows, one.o_rows)
    assert one.gu_tiles == 32 and one.n_o_tiles == math.ceil(2048 / 24)
    # the default one-row plan is paged, its expert items of moe_pages_tile_kb_1row = 96 KB: 8-row gate/up halves
    # (12 rows fit, a multiple of TILE_ROW_QUANTUM is 8), 64-row down items; the static tiles stay tile_kb's
    paged_one = plan_for_rows(default, 1)
    assert paged_one.pg_n and (paged_one.gu_rows, paged_one.dn_rows, paged_one.o_rows) == (8, 64, 24)
    assert 2 * paged_one.gu_rows * 2048 * 2 <= 96 * 1024 and paged_one.dn_rows * 768 * 2 <= 96 * 1024
    full, full0 = plans[-1], default[-1]
    assert (full.gu_rows, full.o_rows, full.qkv_rows, full.dn_rows) == \
        (full0.gu_rows, full0.o_rows, full0.qkv_rows, full0.dn_rows)
    for p in plans:
        assert p.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("B", [1, 3])
def test_simulator_with_tiles_of_any_multiple_of_8_rows(variant, B):
    """tile_kb=3 on the tiny configs: tiles of multiples of 8 rows that are no power of two and leave tails (down:
    48 + 16 rows of 64; O on most variants 24 + 24 + 16), computed exactly in random orders."""
    cfg, w, st, nxt = _setup(variant, B, seed=41 + B)
    plan = ModelPlan(cfg, st.layout, max_batch=4, n_workers=3, split_tokens=4, tile_kb=3, moe_pages=0)
    assert plan.dn_rows == 48 and plan.H % plan.dn_rows and plan.o_rows % 8 == 0
    _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 1])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("B", [1, 2, 3])
def test_simulator_with_fused_norm(variant, B):
    """fused_norm: steps of <= 2 rows drop the NORM tasks of layers >= 1 (their QKV / router / MLP gate-up tiles
    normalise their own rows; one QKV tile writes h, one router tile x); 3 rows keep them. Exact in random orders."""
    cfg, w, st, nxt = _setup(variant, B, seed=21 + B)
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4, fused_norm=2)
    batch = decode_batch(st, nxt)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    rec = build_tasks(plan, si.B, si.nsplit).records
    norms = sorted(set(rec[rec[:, 0] == int(O.Op.NORM), 1].tolist()))
    assert norms == ([0, cfg.num_layers] if B <= 2 else list(range(cfg.num_layers + 1)))
    flags = rec[:, O.R["flags"]]
    assert ((flags & O.FLAG_WRITE_H) != 0).sum() == (cfg.num_layers - 1 if B <= 2 else 0)
    _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 5])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("B", [1, 2])
def test_simulator_with_fused_router_only(variant, B):
    """fused_qkv=0: only the router tiles normalise their own rows (writing neither x nor h); every layer keeps its
    NORM tasks, which the QKV tiles and the MoE workers wait on. Exact in random orders."""
    cfg, w, st, nxt = _setup(variant, B, seed=31 + B)
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4, fused_norm=2, fused_qkv=0)
    batch = decode_batch(st, nxt)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    tl = build_tasks(plan, si.B, si.nsplit)
    validate(tl)
    rec = tl.records
    op, flags = rec[:, 0], rec[:, O.R["flags"]]
    assert sorted(set(rec[op == int(O.Op.NORM), 1].tolist())) == list(range(cfg.num_layers + 1))
    fused = (flags & O.FLAG_FUSED_NORM) != 0
    assert set(op[fused].tolist()) == {int(O.Op.ROUTER)}
    assert (rec[fused, 1] >= 1).all() and not ((flags & (O.FLAG_WRITE_H | O.FLAG_WRITE_X)) != 0).any()
    workers = op == int(O.Op.MOE_WORKER)
    assert (rec[workers, O.R["w1c"]] >= 0).all()          # the workers wait on the layer's NORM too
    _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 7])


def test_fused_norm_plans_on_north_dims_need_no_more_shared_memory():
    """At North dims (H = 2048 <= 8 x 512 threads) a fused_norm tile keeps each row's residual in registers, so the
    default plans with fused_norm take exactly the shared memory (and the tiles) of the plans without it, inside
    the limit; a hidden size past 8 columns per thread stages the fp32 row (and a block sum's scratch)."""
    from megakernel.config import north_mini_code_config
    from megakernel.kernel.plan import fused_norm_smem_bytes, tiling_plans
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)
    base = tiling_plans(cfg, layout, 16, True, n_workers=132, fused_norm=0)
    fused = tiling_plans(cfg, layout, 16, True, n_workers=132, fused_norm=2)
    assert [p.smem_bytes() for p in fused] == [p.smem_bytes() for p in base]
    assert [p.gemv_tiles for p in fused] == [p.gemv_tiles for p in base]
    assert all(p.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE for p in fused)
    assert fused_norm_smem_bytes(2048) == 0
    big = 8 * O.NUM_THREADS + 8
    assert fused_norm_smem_bytes(big) == (big + O.NUM_WARPS) * 4


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_simulator_with_smaller_static_oproj_tasks(variant):
    """o_item_kb without o_queue: a plan whose O projection is static OPROJ tasks cuts them into tasks of at most
    that many KiB (a multiple of TILE_ROW_QUANTUM rows), more of them than the GEMV tiles; exact in random orders."""
    B = 8
    cfg, w, st, nxt = _setup(variant, B, seed=57)
    kb = max(1, O.TILE_ROW_QUANTUM * cfg.num_heads * cfg.head_dim * 2 // 1024)    # the smallest whole quantum
    plain = ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4, o_queue=1)
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4, o_queue=1, o_item_kb=kb)
    assert plan.o_items == 0 and plain.o_rows > O.TILE_ROW_QUANTUM
    assert plan.o_rows == O.TILE_ROW_QUANTUM and plan.n_o_tiles > plain.n_o_tiles
    batch = decode_batch(st, nxt)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    rec = build_tasks(plan, si.B, si.nsplit).records
    per_layer = (rec[:, 0] == int(O.Op.OPROJ)).sum() // cfg.num_layers
    assert per_layer == plan.n_o_tiles
    _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 9])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("B,o_after,o_item_kb", [(1, 0, 0), (4, 0, 0), (1, 8, 0), (4, 3, 0), (1, 8, 1)])
def test_simulator_with_oproj_in_the_expert_queue(variant, B, o_after, o_item_kb):
    """o_queue: a MoE layer's O-projection tiles are items of its expert queue (after the gate/up items and o_after
    eighths of the down items, waiting for the layer's combines) instead of static OPROJ tasks, and the next layer
    waits on the workers' counter only; dense layers keep their OPROJ tasks. Exact in random orders, with fewer
    workers than items; o_item_kb cuts the O items smaller than a GEMV tile (an even count of rows)."""
    cfg, w, st, nxt = _setup(variant, B, seed=31 + B)
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4, o_queue=16, o_after=o_after,
                     o_item_kb=o_item_kb)
    assert plan.o_items == plan.n_o_tiles > 0
    if o_item_kb:
        plain = ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4, o_queue=16, o_after=o_after)
        assert plan.o_rows == max(2, o_item_kb * 1024 // (plan.Q * 2) // 2 * 2) < plain.o_rows
        assert plan.o_items > plain.o_items
    batch = decode_batch(st, nxt)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    rec = build_tasks(plan, si.B, si.nsplit).records
    o_layers = sorted(set(rec[rec[:, 0] == int(O.Op.OPROJ), 1].tolist()))
    assert o_layers == [l for l in range(cfg.num_layers) if not cfg.is_moe(l)]
    _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 9])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("B,o_queue", [(1, 0), (3, 16)])
def test_simulator_with_combines_split_over_query_heads(variant, B, o_queue):
    """combine_parts: each (row, kv head)'s combine as several tasks over parts of its query heads (every head its
    own task here), which the O projection (static tasks, or the queue's O items) waits for all of. Exact in random
    orders, with splits of 4 keys so every combine merges several."""
    cfg, w, st, nxt = _setup(variant, B, seed=41 + B)
    g = cfg.num_heads // cfg.num_kv_heads
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4, combine_parts=g, o_queue=o_queue,
                     o_after=4)
    batch = decode_batch(st, nxt)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    rec = build_tasks(plan, si.B, si.nsplit).records
    comb = rec[rec[:, 0] == int(O.Op.ATTN_COMBINE)]
    assert len(comb) == cfg.num_layers * B * cfg.num_kv_heads * g
    assert sorted(set(comb[:, O.R["a1"]].tolist())) == list(range(cfg.num_kv_heads * g))
    _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 11])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("B,o_queue", [(1, 0), (5, 0), (3, 16)])
def test_simulator_with_workers_routing_themselves(variant, B, o_queue):
    """worker_topk: no TOPK tasks; every MoE worker waits on its layer's router tiles and computes the routing
    itself, and the worker that claims item 0 writes the route record (the host reads it). Exact in random orders,
    with fewer workers than items; the record holds every row's experts."""
    cfg, w, st, nxt = _setup(variant, B, seed=51 + B)
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4, worker_topk=1, o_queue=o_queue)
    batch = decode_batch(st, nxt)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    rec = build_tasks(plan, si.B, si.nsplit).records
    assert not (rec[:, 0] == int(O.Op.TOPK)).any()
    workers = rec[rec[:, 0] == int(O.Op.MOE_WORKER)]
    assert len(workers) == 2 * len(plan.moe_layers)
    assert (workers[:, O.R["w0c"]] == workers[:, O.R["layer"]] * plan.cpl + plan.c_rl).all()
    from megakernel.kernel.plan import route_scratch_bytes
    assert plan.smem_bytes() >= route_scratch_bytes(plan.E) + plan.r_stride * 4     # the workers' routing fits
    _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 13])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("B", [1, 5])
def test_simulator_with_the_last_router_tile_routing(variant, B):
    """router_topk: no TOPK tasks; the router tile that completes its layer's router counter routes the layer and
    signals the top-k counter the workers wait on (a2 of every router record, a3 the tile count). validate() counts
    the router tiles as that counter's producers; exact in random orders (a different tile is last in each)."""
    cfg, w, st, nxt = _setup(variant, B, seed=71 + B)
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4, router_topk=1, router_tile_rows=2)
    batch = decode_batch(st, nxt)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    rec = build_tasks(plan, si.B, si.nsplit).records
    assert not (rec[:, 0] == int(O.Op.TOPK)).any()
    routers = rec[rec[:, 0] == int(O.Op.ROUTER)]
    assert (routers[:, O.R["a3"]] > 1).all()               # several tiles per layer: which one routes varies
    assert (routers[:, O.R["a2"]] == routers[:, O.R["layer"]] * plan.cpl + plan.c_route).all()
    workers = rec[rec[:, 0] == int(O.Op.MOE_WORKER)]
    assert (workers[:, O.R["w0c"]] == workers[:, O.R["layer"]] * plan.cpl + plan.c_route).all()
    _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 13, B + 29])
    with pytest.raises(ValueError, match="pick one"):
        ModelPlan(cfg, st.layout, max_batch=16, router_topk=1, worker_topk=1)


@pytest.mark.parametrize("B", [3, 6])
def test_simulator_with_early_workers(B):
    """workers_early: in plans whose O projection is static tasks (more rows than o_queue), that many of each MoE
    layer's workers are listed right after its QKV tiles, ahead of its attention splits, the rest after the
    combines; validate() holds and the step is exact in random orders. Plans with O items in the queue keep every
    worker after the combines (their O items wait on them)."""
    cfg, w, st, nxt = _setup("north_like", B, seed=83 + B)
    plan = ModelPlan(cfg, st.layout, max_batch=8, n_workers=3, split_tokens=4, o_queue=2, workers_early=2)
    batch = decode_batch(st, nxt)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    rec = build_tasks(plan, si.B, si.nsplit).records
    for l in sorted(plan.moe_idx):
        ops = rec[rec[:, O.R["layer"]] == l][:, 0]
        first_attn = int(np.flatnonzero(ops == int(O.Op.ATTN))[0])
        workers = np.flatnonzero(ops == int(O.Op.MOE_WORKER))
        early = 2 if plan.o_items == 0 else 0
        assert len(workers) == 3 and int((workers < first_attn).sum()) == early
    queued = ModelPlan(cfg, st.layout, max_batch=8, n_workers=3, split_tokens=4, o_queue=8, workers_early=2)
    assert queued.o_items > 0
    rq = build_tasks(queued, si.B, si.nsplit).records
    for l in sorted(queued.moe_idx):
        ops = rq[rq[:, O.R["layer"]] == l][:, 0]
        assert (np.flatnonzero(ops == int(O.Op.MOE_WORKER)) > np.flatnonzero(ops == int(O.Op.ATTN_COMBINE)).max()).all()
    _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 7])


def test_combine_parts_must_divide_the_query_group():
    """North (8 query heads of 128 per kv head): parts of 1, 2 (512 outputs, one per thread), 4 and 8 heads' worth
    plan; 3 does not divide the group."""
    from megakernel.config import north_mini_code_config
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)
    for parts in (1, 2, 4, 8):
        assert ModelPlan(cfg, layout, max_batch=16, combine_parts=parts).combine_parts == parts
    with pytest.raises(ValueError, match="combine_parts"):
        ModelPlan(cfg, layout, max_batch=16, combine_parts=3)


def test_expert_ring_tilings_on_north_dims():
    """moe_ring: the static tasks keep one large buffer (128 KB tiles) while the expert items get a ring of two
    buffers with their inputs after it (the warp-specialised worker's layout): each item tile fits one buffer, the
    plan fits the shared memory, and batch 1 gets ~96 KB expert tiles."""
    from megakernel.config import north_mini_code_config
    from megakernel.kernel.plan import tiling_plans
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    plans = tiling_plans(cfg, KVLayout.for_model(cfg, 64), 16, True, n_workers=132, moe_ring=16, o_queue=0,
                         tile_kb=0)
    assert [p.tb for p in plans] == [2, 4, 8, 16]          # 1 and 2 rows tile alike (the larger tile_batch wins)
    small = tiling_plans(cfg, KVLayout.for_model(cfg, 64), 16, True, n_workers=132, moe_ring=2, o_queue=0)
    assert [p.moe_wbuf > 0 for p in small] == [p.tb <= 2 for p in small] and small[0].tb <= 2 < small[-1].tb
    for p in plans:
        assert p.wbuf == 0 and p.moe_wbuf >= O.PREFETCH_MIN_TILE
        assert 2 * p.gu_rows * (p.H + O.ROW_PAD) * 2 <= p.moe_wbuf and p.dn_rows * (p.I + O.ROW_PAD) * 2 <= p.moe_wbuf
        assert O.GEMV_SCRATCH_BYTES + 2 * p.moe_wbuf + p.tb * (max(p.H, p.I) + O.ROW_PAD) * 2 <= p.smem_bytes()
        assert p.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE
    assert plans[0].qkv_rows * plans[0].H * 2 == 128 * 1024 and 2 * plans[0].gu_rows * plans[0].H * 2 >= 96 * 1024


@pytest.mark.parametrize("B", [1, 3])
def test_simulator_with_the_expert_ring(B):
    """moe_ring changes only the expert items' tile rows (more items per expert): exact in random orders."""
    cfg, w, st, nxt = _setup("north_like", B, seed=41 + B)
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4, moe_ring=16)
    assert plan.moe_wbuf > 0
    _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 3])


def test_lm_head_runs_cover_the_vocab_largest_first():
    """The streaming LM head's runs (plan.lm_runs): they tile the vocabulary exactly and in order, shrink toward
    the end of the list (guided: 2/3 of an even share of what is left over the blocks, at least 4 tiles but the
    last), and a plan without the stream gets one task per tile. At North dims batch 1's plan under o_queue=0,
    tile_kb=0 (a plain one-row plan) has a few hundred runs of 25-row tiles in two 100 KB buffers, the shared
    memory stays inside the limit, and the scratch holds one maximum per run."""
    from megakernel.config import north_mini_code_config
    from megakernel.kernel.plan import lm_runs, plan_for_rows, tiling_plans
    from megakernel.kv.cache import KVLayout

    for vocab, rows, blocks in ((262144, 21, 132), (1000, 7, 3), (50, 64, 132)):
        runs = lm_runs(vocab, rows, blocks)
        starts = [r0 for r0, _ in runs]
        assert starts[0] == 0 and sum(n for _, n in runs) == vocab
        assert all(a + n == b for (a, n), b in zip(runs, starts[1:]))
        tiles = [math.ceil(n / rows) for _, n in runs]
        assert all(a >= b for a, b in zip(tiles, tiles[1:]))
        assert all(t >= 4 for t in tiles[:-1])
    assert lm_runs(1000, 7, 0) == [(r, min(7, 1000 - r)) for r in range(0, 1000, 7)]
    cfg = north_mini_code_config()
    plans = tiling_plans(cfg, KVLayout.for_model(cfg, 64), 16, True, n_workers=132, o_queue=0, tile_kb=0)
    b1 = plan_for_rows(plans, 1)         # (a plain plan of its own: every plan of 2..16 rows is paged)
    assert b1.tb == 1 and b1.lm_wbuf > 0 and b1.lm_rows == 25 and 400 < b1.n_lm_tiles < 1000
    assert 2 * b1.lm_rows * b1.H * 2 <= 2 * b1.lm_wbuf and b1.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE
    assert b1.scratch_spec(torch.bfloat16)["lm_best"][0][0] == b1.n_lm_tiles == len(b1.lm_runs)
    off = tiling_plans(cfg, KVLayout.for_model(cfg, 64), 16, True, n_workers=132, lm_stream=0, o_queue=0,
                       tile_kb=0)[0]
    assert off.lm_wbuf == 0 and off.n_lm_tiles == math.ceil(cfg.vocab_size / off.lm_rows)


def test_router_tile_rows_caps_the_router_tiles():
    """router_tile_rows=N: at most N rows per router tile (more, smaller tiles); the task list stays valid."""
    from megakernel.kernel.schedule import validate

    cfg, w, st, nxt = _setup("north_like", 2, seed=7)
    base = ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4, router_tile_rows=0).router_rows
    assert base > 4
    for cap in (0, 4):
        plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4, router_tile_rows=cap)
        assert plan.router_rows == (4 if cap else base)
        tl = build_tasks(plan, 2, np.full((2, plan.n_groups), 2, dtype=np.int32))
        validate(tl)
        n_router = int((tl.records[:, O.R["op"]] == O.Op.ROUTER).sum())
        assert n_router == plan.Lm * math.ceil(plan.E / plan.router_rows)
    _check_step(cfg, w, st, nxt, ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4,
                                           router_tile_rows=4), seeds=[3])


def test_paged_worker_layout_on_north_dims():
    """moe_pages: only a one-row plan gets the paged MoE worker's layout; its pages hold at least one row of every
    item kind (gate/up and router K = 2048, down K = 768, O K = 4096), its item slots hold the largest input row and
    item, the whole fits the shared memory (with the static part reserved), and the other plans are unchanged."""
    from megakernel.config import north_mini_code_config
    from megakernel.kernel.plan import tiling_plans
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)
    # (the plain worker's item sizes: moe_pages_tile_kb=0; its own sizes: test_paged_items_sized_by_their_own_knob)
    paged = tiling_plans(cfg, layout, 16, True, n_workers=132, moe_pages=1, moe_pages_from=1, moe_pages_tile_kb=0)
    plain = tiling_plans(cfg, layout, 16, True, n_workers=132, moe_pages=0)
    assert [p.tb for p in paged] == [p.tb for p in plain]
    for p, q in zip(paged, plain):
        if p.tb != 1:
            assert p.pg_n == 0 and p.pages_smem_bytes() == 0 and p.smem_bytes() == q.smem_bytes()
            continue
        assert 4 <= p.pg_n <= O.PAGE_MAX and p.pg_in_off == p.pg_n * p.pg_page_bytes
        assert p.pg_rows == 1 and p.pg_in_bytes >= 2 * max(p.I, p.Q) and p.pg_in_bytes % 16 == 0
        assert p.pg_out_rows >= max(2 * p.gu_rows, p.dn_rows, p.o_rows)
        assert p.pg_out_off == p.pg_in_off + p.pg_slots * p.pg_in_bytes
        assert p.pg_x_off >= p.pg_out_off + p.pg_slots * p.pg_out_rows * 4 and p.pg_x_off % 16 == 0
        assert p.pg_state_off >= p.pg_x_off + 2 * p.H and p.pg_state_off % 16 == 0
        assert p.pages_smem_bytes() == p.pg_state_off + O.PAGE_STATE_BYTES
        assert p.pages_smem_bytes() <= p.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE
        # at North dims the ring holds fewer pages than there are computing warps (its end markers wrap it too);
        # moe_pages_max caps it (the GPU tests run a wrapped ring at tiny dims with it)
        assert p.pg_n < O.NUM_WARPS - 1
        capped = tiling_plans(cfg, layout, 16, True, n_workers=132, moe_pages=1, moe_pages_from=1, moe_pages_max=5,
                              moe_pages_tile_kb=0)[0]
        assert capped.pg_n == 5 and capped.pg_in_off == 5 * capped.pg_page_bytes
        # moe_tile_kb=64: gate/up items of 2 x 8 rows (4 pages of 4 rows of 2048), three times as many; down items
        # of 40 rows of 768 (60 KB, 4 pages of 10 rows); the static tiles untouched
        fine = tiling_plans(cfg, layout, 16, True, n_workers=132, moe_pages=1, moe_pages_from=1, moe_tile_kb=64,
                            moe_pages_tile_kb=0)[0]
        assert (fine.gu_rows, fine.gu_tiles, fine.dn_rows) == (8, 3 * p.gu_tiles, 40) and p.gu_rows == 24
        assert (fine.qkv_rows, fine.o_rows, fine.lm_rows) == (p.qkv_rows, p.o_rows, p.lm_rows) and fine.pg_n >= p.pg_n
        assert (p.gemv_tiles, p.gu_rows, p.dn_rows, p.o_items) == (q.gemv_tiles, q.gu_rows, q.dn_rows, q.o_items)
        assert p.pg_page_bytes // (2 * max(p.H, p.I, p.Q)) >= 1


def test_paged_worker_layout_for_several_rows():
    """moe_pages=8: every plan of at most 8 rows gets the paged layout for its tile_batch rows (pg_rows): each item
    slot holds that many rows of a down item's activations (and of an O item's attention output where O items are
    queued), that many rows of outputs, the layer's x rows once, at least 4 pages, all inside the shared memory
    and in order; plans of more rows keep the plain worker; a paged plan is never merged into a plain one."""
    from megakernel.config import north_mini_code_config
    from megakernel.kernel.plan import tiling_plans
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)
    # (o_queue=4: the 1..4-row plans queue their O items, whose inputs the item slots then hold)
    plans = tiling_plans(cfg, layout, 16, True, n_workers=132, moe_pages=8, moe_pages_from=1, o_queue=4,
                         slot_pairs=0, moe_pages_x_item=0)
    paged = [p for p in plans if p.pg_n]
    assert [p.tb for p in paged] == [1, 2, 3, 4, 8]
    # the default (moe_pages=16, moe_pages_from=1, o_queue=1, slot_pairs=4): the 1-, 2-, 3-, 4..9-, 10- and
    # 11..16-row plans are paged with item slots of at most 4 rows, the one-row plan with its O items queued;
    # moe_pages=0 has none
    dflt = tiling_plans(cfg, layout, 16, True, n_workers=132)
    assert [(p.tb, p.pg_rows) for p in dflt if p.pg_n] == [(1, 1), (2, 2), (3, 3), (9, 4), (10, 4), (16, 4)]
    assert dflt[0].pg_n and dflt[0].o_items and not dflt[1].o_items
    assert [p.tb for p in tiling_plans(cfg, layout, 16, True, n_workers=132, moe_pages_from=5) if p.pg_n] == [9, 10, 16]
    assert not any(p.pg_n for p in tiling_plans(cfg, layout, 16, True, n_workers=132, moe_pages=0))
    for p in plans:
        if p.tb > 8:
            assert p.pg_n == 0 and p.pg_rows == 0
            continue
        R = p.pg_rows
        assert R == p.tb and 4 <= p.pg_n <= O.PAGE_MAX and p.pg_in_off == p.pg_n * p.pg_page_bytes
        k_in = max(p.I, p.Q) if p.o_items else p.I
        assert p.pg_in_bytes >= 2 * R * k_in and p.pg_in_bytes % 16 == 0
        assert p.pg_out_rows >= max(2 * p.gu_rows, p.dn_rows, p.o_rows if p.o_items else 0)
        assert p.pg_out_off == p.pg_in_off + p.pg_slots * p.pg_in_bytes
        assert p.pg_x_off >= p.pg_out_off + p.pg_slots * R * p.pg_out_rows * 4 and p.pg_x_off % 16 == 0
        assert p.pg_state_off >= p.pg_x_off + 2 * R * p.H and p.pg_state_off % 16 == 0
        assert p.pages_smem_bytes() <= p.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE
    # the 5..8-row launches run the 8-row paged plan (not a plain plan of the same tiles)
    from megakernel.kernel.plan import plan_for_rows
    assert all(plan_for_rows(plans, b).pg_rows == 8 for b in range(5, 9))


def test_paged_items_sized_by_their_own_knob():
    """moe_pages_tile_kb: the paged plan's expert items sized by the knob (256 KB: 32-row gate/up halves, 128-row down
    items, past the plain worker's 16 / 64 at 8 rows of input), their tiles left out of the GEMV buffer's sizing, the
    page layout still fitting; plans without pages keep the plain sizes; a paged plan whose layout would not fit
    them keeps the plain sizes too."""
    from megakernel.config import north_mini_code_config
    from megakernel.kernel.plan import paged_item_rows, tiling_plans
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)
    base = {p.tb: p for p in tiling_plans(cfg, layout, 16, True, n_workers=132, moe_pages=8, moe_pages_tile_kb=0)}
    big = {p.tb: p for p in tiling_plans(cfg, layout, 16, True, n_workers=132, moe_pages=8, moe_pages_tile_kb=256)}
    assert (paged_item_rows(2048, 2, 256), paged_item_rows(768, 1, 256)) == (32, 128)
    p, q = big[8], base[8]
    assert p.pg_n >= 4 and p.big_items and (p.gu_rows, p.dn_rows) == (32, 128) and (q.gu_rows, q.dn_rows) == (16, 64)
    assert (p.gu_tiles, p.dn_tiles) == (24, 16)
    assert (2048, 64) not in p.gemv_tiles and (768, 128) not in p.gemv_tiles
    assert p.pg_out_rows >= 128 and p.pages_smem_bytes() <= p.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE
    assert not big[16].big_items and (big[16].gu_rows, big[16].dn_rows) == (base[16].gu_rows, base[16].dn_rows)
    # one row: its own size (moe_pages_tile_kb_1row = 96 KB), or the knob's where that is 0
    assert big[1].big_items and (big[1].gu_rows, big[1].dn_rows) == (8, 64)
    own = tiling_plans(cfg, layout, 16, True, n_workers=132, moe_pages=8, moe_pages_tile_kb=256,
                       moe_pages_tile_kb_1row=0)[0]
    assert own.tb == 1 and (own.gu_rows, own.dn_rows) == (32, 128)
    # at 16 rows, 128-row items' outputs would leave fewer than 4 pages: the plain sizes, and their 4 pages
    capped = tiling_plans(cfg, layout, 16, True, n_workers=132, moe_pages=16, moe_pages_from=16,
                          moe_pages_tile_kb=4096, slot_pairs=0)[-1]
    assert capped.tb == 16 and capped.pg_n == 4 and not capped.big_items
    assert (capped.gu_rows, capped.dn_rows) == (16, 64) and (2048, 32) in capped.gemv_tiles


def test_simulator_with_paged_items_of_their_own_size():
    """moe_pages_tile_kb changes the expert items' rows (fewer, larger items): the step stays exact in random orders."""
    cfg, w, st, nxt = _setup("north_like", 3, seed=59)
    plan = ModelPlan(cfg, st.layout, max_batch=4, tile_batch=3, n_workers=2, split_tokens=4, moe_pages=4,
                     moe_pages_from=1, moe_pages_tile_kb=1)
    ref = ModelPlan(cfg, st.layout, max_batch=4, tile_batch=3, n_workers=2, split_tokens=4, moe_pages=4,
                    moe_pages_from=1)
    assert plan.pg_n > 0 and plan.big_items and (plan.gu_rows, plan.dn_rows) != (ref.gu_rows, ref.dn_rows)
    _check_step(cfg, w, st, nxt, plan, seeds=[3, 8])


def test_simulator_with_the_paged_worker():
    """moe_pages changes how a worker streams its items, not the task list: the one-row plan gets the layout and its
    step is exact in random orders."""
    cfg, w, st, nxt = _setup("north_like", 1, seed=47)
    plan = ModelPlan(cfg, st.layout, max_batch=4, tile_batch=1, n_workers=2, split_tokens=4, moe_pages=1,
                     moe_pages_from=1)
    assert plan.pg_n > 0
    _check_step(cfg, w, st, nxt, plan, seeds=[1, 4])


def _one_row_north_plans(monkeypatch):
    """A maker of the one-row North plan (132 workers) under whatever $MEGAKERNEL_KERNEL_DEFINES the test sets after
    this call (cleared here): the build switches that shape the paged worker's layout."""
    from megakernel.config import north_mini_code_config
    from megakernel.kv.cache import KVLayout

    monkeypatch.delenv("MEGAKERNEL_KERNEL_DEFINES", raising=False)
    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)
    return lambda: ModelPlan(cfg, layout, max_batch=1, n_workers=132)


def test_paged_layout_follows_the_builds_item_slots(monkeypatch):
    """MK_PAGE_SLOTS (a build switch): the paged plans lay out that many items' input and output buffers, so with 4
    item slots the one-row North plan's ring keeps one page less (an 8 KB input buffer per slot) and still fits; a
    count outside PAGE_SLOTS_RANGE is refused, and a plan whose count differs from the loaded library's
    (mk_page_slots) is refused (check_page_layout) instead of overrunning its shared memory."""
    from megakernel.kernel import build
    from megakernel.kernel.backend import check_page_layout

    make = _one_row_north_plans(monkeypatch)
    three = make()
    assert three.pg_slots == O.PAGE_SLOTS == 3 and three.pg_n == 12
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_PAGE_SLOTS=4")
    four = make()
    assert four.pg_slots == 4 and four.pg_n == 11
    assert four.pg_out_off == four.pg_in_off + 4 * four.pg_in_bytes
    assert four.pg_x_off >= four.pg_out_off + 4 * four.pg_rows * four.pg_out_rows * 4
    assert four.pages_smem_bytes() <= four.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE
    check_page_layout([four], 4, O.PAGE_BYTES, 1)
    with pytest.raises(ValueError, match="MK_PAGE_SLOTS=4"):
        check_page_layout([three], 4, O.PAGE_BYTES, 1)
    with pytest.raises(ValueError, match="library has MK_PAGE_SLOTS=3"):
        check_page_layout([three, four], 3, O.PAGE_BYTES, 1)
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_PAGE_SLOTS=9")
    with pytest.raises(build.BuildError, match="MK_PAGE_SLOTS=9"):
        make()


def test_paged_layout_follows_the_builds_page_bytes(monkeypatch):
    """MK_PAGE_BYTES (a build switch): 32 KB ring pages halve the one-row North plan's ring page count (12 -> 6, the
    same bytes) and the input buffers start after them; a size outside PAGE_BYTES_CHOICES is refused, and a plan laid out for another size than the
    loaded library's (mk_page_bytes) is refused (check_page_layout)."""
    from megakernel.kernel import build
    from megakernel.kernel.backend import check_page_layout

    make = _one_row_north_plans(monkeypatch)
    small = make()
    assert small.pg_page_bytes == O.PAGE_BYTES == 16384 and small.pg_n == 12
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_PAGE_BYTES=32768")
    big = make()
    assert big.pg_page_bytes == 32768 and big.pg_n == 6 and big.pg_in_off == 6 * 32768
    assert big.pages_smem_bytes() <= big.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE
    check_page_layout([big], O.PAGE_SLOTS, 32768, 1)
    with pytest.raises(ValueError, match="library has MK_PAGE_BYTES=16384"):
        check_page_layout([small, big], O.PAGE_SLOTS, 16384, 1)
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_PAGE_BYTES=8192")
    with pytest.raises(build.BuildError, match="MK_PAGE_BYTES=8192"):
        make()
    # two computing warps per page (MK_PG_PAGE_WARPS=2): the same 6 pages of 32 KB keep 12 computing warps; 16 KB
    # pages are capped at 7 (14 computing warps); a library with one warp per page refuses such plans
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_PAGE_BYTES=32768,MK_PG_PAGE_WARPS=2")
    shared = make()
    assert shared.pg_n == 6 and shared.pg_page_warps == 2 and shared.pg_n * 2 <= O.NUM_WARPS - 2
    check_page_layout([shared], O.PAGE_SLOTS, 32768, 2)
    with pytest.raises(ValueError, match="library has MK_PG_PAGE_WARPS=1"):
        check_page_layout([shared], O.PAGE_SLOTS, 32768, 1)
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_PG_PAGE_WARPS=2")
    assert make().pg_n == (O.NUM_WARPS - 2) // 2
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_PG_PAGE_WARPS=3")
    with pytest.raises(build.BuildError, match="MK_PG_PAGE_WARPS=3"):
        make()


@pytest.mark.parametrize("n_slots,lag", [(1, 1), (5, 0), (5, 1), (5, 2), (5, 4), (5, 5), (5, 9), (17, 3), (17, 8),
                                         (17, 12), (40, 12), (40, 32), (20, 32)])
@pytest.mark.parametrize("lag_min", [0, O.DN_LAG_MIN])
def test_queue_order_with_down_lag(n_slots, lag, lag_min, monkeypatch):
    """dn_lag: the queue is a permutation of the layer's items (every gate/up and down tile of every slot once),
    each down item after all of its slot's gate/up items, and the down items of slot s right after the gate/up
    items of slot s + k for k = min(lag, half the slots), or (k under DN_LAG_MIN, or 0) every down item after every
    gate/up item. lag_min 0: the order the small test dims can reach (their steps have fewer slots than
    DN_LAG_MIN)."""
    from megakernel.kernel.simulator import queue_kind

    monkeypatch.setattr(O, "DN_LAG_MIN", lag_min)
    k = min(lag, n_slots // 2)
    k = 0 if k < lag_min else k
    G, D = 3, 2
    order = [queue_kind(n_slots, G, D, lag, i) for i in range(n_slots * (G + D))]
    assert sorted(order) == sorted([(False, s, t) for s in range(n_slots) for t in range(G)] +
                                   [(True, s, t) for s in range(n_slots) for t in range(D)])
    pos = {key: i for i, key in enumerate(order)}
    for s in range(n_slots):
        assert min(pos[(True, s, t)] for t in range(D)) > max(pos[(False, s, t)] for t in range(G))
        if 0 < k and s + k < n_slots:
            assert pos[(True, s, 0)] == pos[(False, s + k, G - 1)] + 1
    if k == 0:
        assert all(not d for d, _, _ in order[:n_slots * G])
    else:
        assert order[(k + 1) * G] == (True, 0, 0)        # (slot k's gate/up items, then slot 0's down items)


@pytest.mark.parametrize("pages", [4])
@pytest.mark.parametrize("lag", [1, 2])
def test_simulator_with_down_lag(pages, lag, monkeypatch):
    """dn_lag interleaves the down items with later experts' gate/up items (paged plans without queued O items; the
    plain worker's order is the same formula, checked at lag 0 by the other tests): the step stays exact in random
    orders, and no worker waits forever (each down item's gate/up items are earlier in the queue). DN_LAG_MIN is set
    to 0 here: the tiny dims' steps have fewer expert slots than it, which would turn the lag off."""
    monkeypatch.setattr(O, "DN_LAG_MIN", 0)
    cfg, w, st, nxt = _setup("north_like", 3, seed=61 + lag)
    plan = ModelPlan(cfg, st.layout, max_batch=4, tile_batch=3, n_workers=2, split_tokens=4, moe_pages=pages,
                     moe_pages_from=1, o_queue=0, dn_lag=lag)
    assert plan.queue_dn_lag == lag and plan.o_items == 0 and (plan.pg_n > 0) == (pages > 0)
    _check_step(cfg, w, st, nxt, plan, seeds=[5, 9])
    queued = ModelPlan(cfg, st.layout, max_batch=4, tile_batch=3, n_workers=2, split_tokens=4, o_queue=4, dn_lag=lag)
    assert queued.o_items and queued.queue_dn_lag == 0
    plain = ModelPlan(cfg, st.layout, max_batch=4, tile_batch=3, n_workers=2, split_tokens=4, o_queue=0, dn_lag=lag,
                      moe_pages=0)
    assert plain.queue_dn_lag == 0 and not plain.pg_n


@pytest.mark.parametrize("pages,o_queue", [(0, 0), (8, 0), (8, 8)])
@pytest.mark.parametrize("R", [1, 2])
def test_simulator_with_split_expert_slots(R, pages, o_queue):
    """slot_pairs=R: an expert chosen by more than R rows gets several queue slots of at most R pairs (consecutive,
    its pairs in row order), each with its own gate/up and down items and counter; the step stays exact in random
    orders (plain and paged workers, with and without queued O items), and its route records have such splits."""
    cfg, w, st, nxt = _setup("north_like", 5, seed=71 + R)
    plan = ModelPlan(cfg, st.layout, max_batch=8, tile_batch=5, n_workers=2, split_tokens=4, moe_pages=pages,
                     moe_pages_from=1, o_queue=o_queue, slot_pairs=R)
    assert (plan.pg_n > 0) == (pages > 0)
    if plan.pg_n:
        assert plan.pg_rows == (plan.tb if plan.o_items else R)
    sim = Simulator(plan, w)
    batch = decode_batch(st, nxt)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    sim.step(si, build_tasks(plan, si.B, si.nsplit), clone_cache(st.cache), seed=1)
    splits = 0
    for route in sim.buf["route"][:plan.Lm]:
        n = int(route[0])
        cnts = [int(route[plan.r_slot_cnt + j]) for j in range(n)]
        starts = [int(route[plan.r_slot_start + j]) for j in range(n)]
        experts = [int(route[plan.r_slot_expert + j]) for j in range(n)]
        assert max(cnts) <= R and sum(cnts) == si.B * plan.topk and starts == [sum(cnts[:j]) for j in range(n)]
        assert experts == sorted(experts) and n <= plan.n_slots
        assert int(route[1]) == n * (plan.gu_tiles + plan.dn_tiles) + plan.o_items
        splits += n - len(set(experts))
    assert splits > 0                    # (5 rows of north_like share experts)
    _check_step(cfg, w, st, nxt, plan, seeds=[2, 6])


def test_split_slots_leave_the_paged_ring_more_pages():
    """slot_pairs at North dims: the paged plans' item slots hold slot_pairs rows (the x rows still every row), so
    the 16-row plan keeps 6 pages at 8 and 8 at 4 (4 without), the 8-row plan 10 at 4 (8 without); the queue may
    have an expert in several slots, within n_slots (never more than the pairs); everything fits."""
    from megakernel.config import north_mini_code_config
    from megakernel.kernel.plan import tiling_plans
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)

    def full(**kw):
        return {p.tb: p for p in tiling_plans(cfg, layout, 16, True, n_workers=132, moe_pages_x_item=0, **kw)}
    base16, s8, s4 = (full(moe_pages=16, moe_pages_from=9, slot_pairs=n) for n in (0, 8, 4))
    assert (base16[16].pg_rows, base16[16].pg_n) == (16, 4)
    assert (s8[16].pg_rows, s8[16].pg_n) == (8, 6) and (s4[16].pg_rows, s4[16].pg_n) == (4, 8)
    eight = lambda n: full(moe_pages=8, slot_pairs=n)[8]     # noqa: E731
    assert (eight(0).pg_n, eight(4).pg_n, eight(4).pg_rows) == (8, 10, 4)
    for p in (*s8.values(), *s4.values()):
        assert p.n_slots <= p.n_pairs and p.pages_smem_bytes() <= p.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE
        if p.pg_n:
            assert p.pg_x_off + 2 * p.tb * p.H <= p.pg_state_off      # (every row's x)
    tiny = ModelPlan(make_cfg("north_like"), KVLayout.for_model(make_cfg("north_like"), 16), max_batch=8,
                     slot_pairs=2)
    assert tiny.n_slots == min(tiny.n_pairs, min(tiny.E, tiny.n_pairs) + tiny.n_pairs // 2)


def test_paged_gate_up_items_load_their_own_x_rows_where_that_frees_pages():
    """moe_pages_x_item: at North dims the 10..16-row paged plans drop the shared buffer of every row's x (64 KB at
    16 rows) for per-item x rows in the item slots (4 rows of 2048), which keeps 10 ring pages instead of 8 (9 at 10
    rows); the 1..9-row plans keep the shared rows (per-item rows would not add a page); 0 turns it off, 2 forces
    it; every layout fits, the slots hold pg_rows rows of the widest input; the step stays exact with it forced."""
    from megakernel.config import north_mini_code_config
    from megakernel.kernel.plan import tiling_plans
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)

    def plans(**kw):
        return {p.tb: p for p in tiling_plans(cfg, layout, 16, True, n_workers=132, **kw) if p.pg_n}
    auto, off, forced = plans(), plans(moe_pages_x_item=0), plans(moe_pages_x_item=2)
    assert [(tb, p.pg_x_item, p.pg_n) for tb, p in auto.items()] == [(1, 0, 12), (2, 0, 12), (3, 0, 11), (9, 0, 10),
                                                                     (10, 1, 10), (16, 1, 10)]
    assert [(tb, p.pg_n) for tb, p in off.items() if tb >= 10] == [(10, 9), (16, 8)] and not any(
        p.pg_x_item for p in off.values())
    for p in (*auto.values(), *off.values(), *forced.values()):
        assert p.pages_smem_bytes() <= p.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE
        k_in = max(p.I, p.H if p.pg_x_item else 0)
        assert p.pg_in_bytes >= 2 * p.pg_rows * k_in
        assert p.pg_state_off >= p.pg_x_off + (0 if p.pg_x_item else 2 * p.tb * p.H)
    assert all(p.pg_x_item for p in forced.values())
    cfg, w, st, nxt = _setup("north_like", 3, seed=61)
    plan = ModelPlan(cfg, st.layout, max_batch=4, tile_batch=3, n_workers=2, split_tokens=4, moe_pages=4,
                     moe_pages_from=1, moe_pages_x_item=2, slot_pairs=2)
    assert plan.pg_n and plan.pg_x_item and plan.pg_rows == 2
    _check_step(cfg, w, st, nxt, plan, seeds=[4, 9])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("B,claims_held", [(1, 3), (4, 2), (4, 3)])
def test_simulator_with_workers_claiming_ahead(variant, B, claims_held):
    """The paged worker claims ahead (MK_PG_CLAIM_LEAD: two held; up to three here): a worker holds claimed
    items while the first waits for its dependency (a down item for its gate/up items, an O item for the
    combines). With two workers and O items queued, exact in random orders and no deadlock, as the argument in
    mk_moe_pages.cuh says."""
    cfg, w, st, nxt = _setup(variant, B, seed=41 + B + claims_held)
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=2, split_tokens=4, o_queue=16)
    _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 5, B + 11], claims_held=claims_held)


class _ClaimRecorder(Simulator):
    """Records, for each MoE item claim, whether the claiming worker's wait for the routing was already met, and
    checks after each step that every early claim was run."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.claims: list[bool] = []

    def step(self, si, tl, cache, seed=0):
        self.records = tl.records
        res = super().step(si, tl, cache, seed=seed)
        assert not self.early_claim, "a worker's early claim was never used"
        return res

    def _claim(self, m):
        r = self.records[self.cur]
        c, t = int(r[O.R["w0c"]]), int(r[O.R["w0t"]])
        self.claims.append(bool(self.counters[c] >= t))
        return super()._claim(m)


@pytest.mark.parametrize("B,claims_held", [(1, 1), (4, 2)])
def test_simulator_with_workers_claiming_before_the_routing(B, claims_held):
    """worker_claim_early: a worker claims its first item before its wait for the routing (the kernel's thread 0,
    its atomic in flight during the wait). In random orders some claims come before TOPK ran; the step stays exact
    and nothing deadlocks (schedule.py's argument: a claim is a counter, the item's dependencies follow the
    routing). Without the knob every claim follows the wait."""
    for early in (0, 1):
        cfg, w, st, nxt = _setup("north_like", B, seed=71 + B)
        plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=3, split_tokens=4, o_queue=16,
                         worker_claim_early=early)
        sim = _ClaimRecorder(plan, w, claims_held=claims_held)
        _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 3, B + 9], sim=sim)
        assert any(sim.claims)
        if early:
            assert not all(sim.claims), "no claim came before its worker's routing was ready"
        else:
            assert all(sim.claims), "without the knob a worker claims only after its wait"


def test_simulator_refuses_a_worker_holding_nothing():
    cfg = make_cfg(sorted(VARIANTS)[0])
    w = tiny_weights(cfg)
    st = prefill_state(cfg, w, [5], chunk=16)
    with pytest.raises(ValueError, match="claims_held=0"):
        Simulator(ModelPlan(cfg, st.layout, max_batch=16), w, claims_held=0)

