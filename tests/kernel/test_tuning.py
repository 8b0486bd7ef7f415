"""The per-card plan overrides (kernel/tuning.py): which card gets which row, that every row's plans fit the shared
memory at North dims and give the item sizes they were measured with, that the simulator runs their task lists
exactly, and the environment's overrides."""

from __future__ import annotations

import numpy as np
import pytest

from megakernel.kernel import opcodes as O
from megakernel.kernel.plan import ModelPlan, plan_for_rows, tiling_plans
from megakernel.kernel import build
from megakernel.kernel.tuning import (CARD_SWITCHES, CARD_TUNING, TUNING_KEYS, card_switches, card_tuning,
                                      select_card_build, tuning_from_env)


def test_cards_match_by_name():
    h200 = card_tuning("NVIDIA H200")
    assert h200 == dict(CARD_TUNING[0][1]) and h200["moe_pages_tile_kb_1row"] == 128
    assert card_tuning("NVIDIA H100 80GB HBM3") == {"wider_split_batch": 3}
    # only the cards measured: relatives with other SM counts, memory or clocks get the plan's defaults
    for name in ("NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H800",
                 "NVIDIA GeForce RTX 4090", ""):
        assert card_tuning(name) == {}, name
    h200["moe_pages_tile_kb"] = 1                               # a copy: the table is not changed through it
    assert card_tuning("NVIDIA H200")["moe_pages_tile_kb"] == 512


def test_every_card_row_names_tuning_keys():
    for key, knobs in CARD_TUNING:
        assert set(knobs) <= set(TUNING_KEYS), key
        assert all(isinstance(v, int) and v >= 0 for v in knobs.values()), key


@pytest.mark.parametrize("card", [key.split()[1] for key, _ in CARD_TUNING])
def test_card_rows_on_north_dims(card):
    """Each row's plans fit the shared memory, keep the plan list's shape, and give the items it was measured with
    (H200: 128 KB one-row gate/up items, 512 KB from two rows; the 2-row plan's O tiles ahead of 16 late workers)."""
    from megakernel.config import north_mini_code_config
    from megakernel.kv.cache import KVLayout

    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)
    knobs = card_tuning(next(key for key, _ in CARD_TUNING if key.split()[1] == card))
    plans = tiling_plans(cfg, layout, 16, True, n_workers=132, **knobs)
    base = tiling_plans(cfg, layout, 16, True, n_workers=132)
    assert [p.tb for p in plans] == [p.tb for p in base]
    for p in plans:
        assert p.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE
    row_bytes = 2 * cfg.hidden_size                                # one gate or up row of an expert, bf16
    if card == "H200":
        one, two = plan_for_rows(plans, 1), plan_for_rows(plans, 2)
        assert 2 * one.gu_rows * row_bytes == 128 * 1024          # gate + up halves
        assert 2 * two.gu_rows * row_bytes == 512 * 1024
        assert all(2 * p.gu_rows * row_bytes == 512 * 1024 for p in plans[1:])
        assert two.o_late_workers == 16 and plan_for_rows(base, 2).o_late_workers == ModelPlan.o_workers_after_2row
    if card == "H100":                                          # 2048-key splits from 3 rows (8K), 512 at 2
        wide = 4 * O.DEFAULT_SPLIT_TOKENS
        assert [plan_for_rows(plans, b).split_size(8192, b) for b in (2, 3, 16)] == [O.DEFAULT_SPLIT_TOKENS,
                                                                                     wide, wide]
        assert plan_for_rows(base, 3).split_size(8192, 3) == O.DEFAULT_SPLIT_TOKENS


@pytest.mark.parametrize("B", [1, 2, 5])
def test_simulator_under_the_h200_row(B):
    """The H200 row's task lists run exactly in random orders. At tiny dims its item sizes are capped by the tiny
    experts, but at 2 rows its O tiles' place among 24 workers differs from the default's (asserted), and that list
    is simulated. (The H100 row changes split sizes only, which contexts this short cannot show: its sizes on North
    dims are test_card_rows_on_north_dims', and 2048-key splits run on the GPU at 16 rows by default.)"""
    from test_simulator import _check_step, _setup

    from megakernel.kernel.schedule import build_tasks

    cfg, w, st, nxt = _setup("north_like", B, seed=40 + B)
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=24, split_tokens=4, tile_batch=B,
                     **card_tuning("NVIDIA H200"))
    base = ModelPlan(cfg, st.layout, max_batch=16, n_workers=24, split_tokens=4, tile_batch=B)
    nsplit = np.ones((B, plan.n_groups), dtype=np.int32)
    differs = not np.array_equal(build_tasks(plan, B, nsplit).records, build_tasks(base, B, nsplit).records)
    assert differs == (B == 2)            # (one row queues its O items; 5 rows order theirs by o_workers_after)
    _check_step(cfg, w, st, nxt, plan, seeds=[B, B + 7])


def test_tuning_from_env(monkeypatch):
    monkeypatch.setenv("MEGAKERNEL_MK_TUNING", " dn_lag=16, split_align=512 ")
    assert tuning_from_env() == {"dn_lag": 16, "split_align": 512}
    monkeypatch.setenv("MEGAKERNEL_MK_TUNING", "no_such_knob=1")
    with pytest.raises(ValueError, match="no_such_knob"):
        tuning_from_env()
    monkeypatch.setenv("MEGAKERNEL_MK_TUNING", "dn_lag=-1")
    with pytest.raises(ValueError, match="KEY=INT"):
        tuning_from_env()
    monkeypatch.delenv("MEGAKERNEL_MK_TUNING")
    assert tuning_from_env() == {}


def test_card_switches_by_name(monkeypatch):
    """The build-switch rows (CARD_SWITCHES): the H200 (32 KB pages, two warps each) and the H100 SXM (the routed
    experts' regions warmed by the routing block), no other name, known switch names with allowed values, a copy per
    call, and none where $MEGAKERNEL_CARD_SWITCHES=0 (A/Bs against the plain default)."""
    monkeypatch.delenv("MEGAKERNEL_CARD_SWITCHES", raising=False)
    assert card_switches("NVIDIA H200") == {"MK_PAGE_BYTES": 32768, "MK_PG_PAGE_WARPS": 2}
    assert card_switches("NVIDIA H100 80GB HBM3") == {"MK_PG_TLB_WARM": 3}
    for name in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA GH200 480GB", ""):
        assert card_switches(name) == {}, name
    for key, switches in CARD_SWITCHES:
        assert set(switches) <= set(build.KERNEL_SWITCHES), key
        assert switches.get("MK_PAGE_BYTES", build.opcodes.PAGE_BYTES) in build.PAGE_BYTES_CHOICES, key
    card_switches("NVIDIA H200")["MK_PAGE_BYTES"] = 1
    assert card_switches("NVIDIA H200")["MK_PAGE_BYTES"] == 32768
    # select_card_build: the row becomes this process's build selection (tests/conftest.py restores it)
    assert select_card_build("NVIDIA H200") == {"MK_PAGE_BYTES": 32768, "MK_PG_PAGE_WARPS": 2}
    assert build.card_switch_selection() == {"MK_PAGE_BYTES": 32768, "MK_PG_PAGE_WARPS": 2}
    assert select_card_build("NVIDIA H100 80GB HBM3") == {"MK_PG_TLB_WARM": 3}
    assert build.card_switch_selection() == {"MK_PG_TLB_WARM": 3}
    assert select_card_build("NVIDIA H100 PCIe") == {} and build.card_switch_selection() == {}
    monkeypatch.setenv("MEGAKERNEL_CARD_SWITCHES", "0")
    assert card_switches("NVIDIA H200") == {}
    assert select_card_build("NVIDIA H200") == {} and build.card_switch_selection() == {}


def test_h200_plans_under_its_build_switches(monkeypatch):
    """What an H200 runs: its plan row with its build row (32 KB ring pages, two computing warps each). Every plan fits
    the shared memory, the paged plans lay out 32 KB pages with at most 6 of them (12 computing warps), and the
    one-row plan keeps its 128 KB gate/up items (4 pages). (tests/conftest.py restores the card selection.)"""
    from megakernel.config import north_mini_code_config
    from megakernel.kv.cache import KVLayout

    monkeypatch.delenv("MEGAKERNEL_KERNEL_DEFINES", raising=False)
    monkeypatch.delenv("MEGAKERNEL_CARD_SWITCHES", raising=False)
    cfg = north_mini_code_config()
    layout = KVLayout.for_model(cfg, 64)
    build.select_card_switches(card_switches("NVIDIA H200"))
    plans = tiling_plans(cfg, layout, 16, True, n_workers=132, **card_tuning("NVIDIA H200"))
    paged = [p for p in plans if p.pg_n]
    assert paged
    for p in plans:
        assert p.smem_bytes() <= O.SMEM_LIMIT - O.SMEM_RESERVE
    for p in paged:
        assert p.pg_page_bytes == 32768 and p.pg_page_warps == 2 and 4 <= p.pg_n <= 6, (p.tb, p.pg_n)
    one = plan_for_rows(plans, 1)
    assert 2 * one.gu_rows * 2 * cfg.hidden_size == 128 * 1024
