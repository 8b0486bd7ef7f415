"""The two-blocks-per-SM experiment (MEGAKERNEL_BLOCKS_PER_SM=2, read by opcodes.py at import, so each check runs in
a fresh interpreter): its constants, the North plans inside half an SM's shared memory, the simulator's exactness on
its plans, and (where nvcc is installed) a build whose entry function does not spill."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel_helpers import run_in_fresh_interpreter


def _run(code: str, tmp_path: Path | None = None) -> str:
    return run_in_fresh_interpreter(code, {"MEGAKERNEL_BLOCKS_PER_SM": "2"}, tmp_path)


def test_constants_and_north_plans_fit_half_an_sm():
    """256 threads, 8 rows, 64-key attention chunks, 113 KB per block; every North plan (1..8 rows) fits it with the
    static part reserved, batch 1 gets 96 KB gate/up tiles (12 rows per half, TILE_ROW_QUANTUM 4) and the header
    carries the shape."""
    out = _run("""
        from megakernel.kernel import opcodes as O
        from megakernel.config import north_mini_code_config
        from megakernel.kernel.plan import tiling_plans, plan_for_rows
        from megakernel.kv.cache import KVLayout
        assert (O.BLOCKS_PER_SM, O.NUM_THREADS, O.NUM_WARPS, O.MAX_BATCH) == (2, 256, 8, 8)
        assert O.ATTN_CHUNK == 64 and O.ATTN_WARPS == 4 and O.SMEM_LIMIT == 113 * 1024
        h = O.generate_header()
        assert "#define MK_BLOCKS_PER_SM 2" in h and "#define MK_NUM_THREADS 256" in h
        cfg = north_mini_code_config()
        plans = tiling_plans(cfg, KVLayout.for_model(cfg, 64), O.MAX_BATCH, True, n_workers=264)
        for p in plans:
            assert p.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE, (p.tb, p.smem_bytes())
        # (the plain worker's one-row tiles: the default pages one row, its items sized by moe_pages_tile_kb_1row)
        plans = tiling_plans(cfg, KVLayout.for_model(cfg, 64), O.MAX_BATCH, True, n_workers=264, moe_pages_from=2)
        one = plan_for_rows(plans, 1)
        assert one.gu_rows == 12 and 2 * one.gu_rows * one.H * 2 == 96 * 1024
        print("ok", [p.tb for p in plans])
    """)
    assert out.startswith("ok")


def test_simulator_matches_torch_on_two_block_plans():
    """The task lists of the two-block plans (12-row tiles with tails) run exactly in random orders on the tiny
    configs: test_simulator's own check (logits, experts, KV cache), in the experiment's interpreter."""
    out = _run("""
        from kernel_helpers import VARIANTS
        from megakernel.kernel.plan import ModelPlan
        from test_simulator import _check_step, _setup
        for name in sorted(VARIANTS):
            for B in (1, 5):
                cfg, w, st, nxt = _setup(name, B, seed=3)
                plan = ModelPlan(cfg, st.layout, max_batch=8, n_workers=4, split_tokens=4, tile_kb=3)
                _check_step(cfg, w, st, nxt, plan, seeds=[0, 1])
        print("ok")
    """)
    assert out.strip() == "ok"


def test_two_block_build_compiles_without_spills(tmp_path):
    """The build of 256-thread blocks, two per SM (__launch_bounds__(256, 2): at most 128 registers, as today)
    compiles, its entry function does not spill, and its static shared memory fits the reserve."""
    from megakernel.kernel import build

    if build.find_nvcc() is None:
        pytest.skip("nvcc not installed")
    out = _run("""
        from megakernel.kernel import build
        from test_build import check_build_log
        lib = build.build("sm_90a")
        check_build_log((lib.parent / "build.log").read_text())
        print("ok")
    """, tmp_path)
    assert out.strip() == "ok"
