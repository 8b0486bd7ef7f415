"""The three-stage attention ring experiment (MEGAKERNEL_ATTN_MAX_STAGES=3, read by opcodes.py at import, so each check
runs in a fresh interpreter): the North plans accept attn_stages=3 inside the shared memory, the simulator stays exact
with three stages, and (where nvcc is installed) the build's entry function does not spill."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel_helpers import run_in_fresh_interpreter


def _run(code: str, tmp_path: Path | None = None) -> str:
    return run_in_fresh_interpreter(code, {"MEGAKERNEL_ATTN_MAX_STAGES": "3"}, tmp_path)


def test_three_stage_plans_fit_and_the_header_carries_them():
    """Every North plan with attn_stages=3 fits the shared memory with the static part reserved (the ring, 206 KB, is
    the largest attention layout), a plan of attn_stages=4 is refused, and the generated header says 3."""
    _run("""
        import pytest
        from megakernel.kernel import opcodes as O
        from megakernel.config import north_mini_code_config
        from megakernel.kernel.plan import attn_smem_bytes, tiling_plans
        from megakernel.kv.cache import KVLayout
        assert O.ATTN_MAX_STAGES == 3 and "MK_ATTN_MAX_STAGES 3" in O.generate_header()
        cfg = north_mini_code_config()
        layout = KVLayout.for_model(cfg, 64)
        assert attn_smem_bytes(128, 8) == 3 * 2 * 128 * 136 * 2 + 8 * 136 * 2 + O.ATTN_TABLE_SLOTS * 4
        for p in tiling_plans(cfg, layout, 16, True, n_workers=132, attn_stages=3):
            p.check_supported()
            assert p.attn_stages == 3 and attn_smem_bytes(p.d, p.g) <= p.smem_bytes()
            assert p.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE, (p.tb, p.smem_bytes())
        with pytest.raises(ValueError, match="attn_stages"):
            tiling_plans(cfg, layout, 16, True, n_workers=132, attn_stages=4)[-1].check_supported()
    """)


def test_simulator_exact_with_three_stages():
    """The simulator runs a three-stage plan's task list in random orders and matches the reference (the stage count
    changes the kernel's ring, not the task list: this guards the plan and the scratch layout)."""
    _run("""
        import test_simulator as ts
        from megakernel.kernel.plan import ModelPlan
        cfg, w, st, nxt = ts._setup("north_like", 2, seed=5)
        plan = ModelPlan(cfg, st.layout, max_batch=4, n_workers=3, split_tokens=4, attn_stages=3)
        ts._check_step(cfg, w, st, nxt, plan, seeds=[1, 2])
    """)


def test_three_stage_build_does_not_spill(tmp_path):
    from megakernel.kernel import build

    if build.find_nvcc() is None:
        pytest.skip("nvcc not installed")
    _run("""
        from megakernel.kernel import build
        from test_build import check_build_log
        lib = build.build("sm_90a", build.switch_flags())
        check_build_log((lib.parent / "build.log").read_text())
    """, tmp_path)
