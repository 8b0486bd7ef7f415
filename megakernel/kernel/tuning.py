"""The megakernel's plan overrides: which plan knobs may be tuned, the backend's defaults, the per-card table, and
the environment's overrides for measurements.

The per-card build switches (CARD_SWITCHES) are the kernel's compile-time counterpart: build.switch_flags applies
them under $MEGAKERNEL_KERNEL_DEFINES once the backend has named its card (build.select_card_switches).

Precedence, lowest first: the ModelPlan defaults (tuned on the H100, sessions 17-30), the card's row of CARD_TUNING,
$MEGAKERNEL_MK_TUNING, then the backend's keyword arguments. A row holds what measured better on its card than the
plan's defaults; the defaults stay put so that task lists built without a GPU (the simulator, the CPU tests) do not
depend on the card, and a card without a row runs what was measured on the H100.
"""

from __future__ import annotations

import os

from megakernel.kernel import build

TUNING_KEYS = ("split_tokens", "attn_stages", "n_workers", "oproj_first", "qkv_by_head", "fused_norm", "batch_tiles",
               "qkv_fill_rows", "qkv_late_weights", "prefetch", "o_queue", "moe_ring", "router_first", "lm_stream",
               "claim_ahead", "router_tile_rows", "moe_claim_late", "o_after",
               "combine_parts", "worker_topk", "tile_kb", "topk_warp", "router_topk", "wide_split_batch",
               "wider_split_batch", "short_splits", "fused_qkv", "moe_pages", "moe_pages_max", "split_align",
               "moe_tile_kb", "moe_pages_claim_late", "workers_early",
               "moe_pages_from", "moe_pages_tile_kb", "dn_lag", "slot_pairs", "moe_pages_x_item",
               "moe_pages_tile_kb_1row", "attn_dsplit_rows", "l2_prefetch", "moe_pages_early", "o_item_kb", "topk_warm",
               "o_workers_after", "o_workers_after_2row", "split_waves", "worker_claim_early")
DEFAULT_TUNING = {"batch_tiles": 1}     # per-batch tilings: measured ahead (b1 8K 5.44 vs 5.52 ms), and the prefetch
                                        # and expert-ring layouts size their buffers by the launch's rows

# Per card, by the exact CUDA device name (torch.cuda.get_device_name): a row holds what was measured on that card,
# so its relatives (H200 NVL, GH200, H100 PCIe with 114 SMs) get the plan's defaults until measured. The H200 reads
# HBM ~1.36x as fast as the H100 with the same 132 SMs, so what bounds a step there is more often the bytes an SM
# keeps in flight and what each item costs, not HBM: larger expert items pay. Measured at 715ce62 on an H200, one
# process per call (benchmarks/results/speed_20261206s31, calls 4-13), against the plan's defaults:
#   moe_pages_tile_kb 256 -> 512: b16 8K 15.32-15.43 -> 14.91-14.99 ms (-2.7%), b12 -2.6%, b8 -2.0%, b6 -1.4%,
#     b3 -1.1%, b2 and b4 even (768, 1024 and 2048 within 0.4% of 512; 128 +5%; on the H100 within 1%);
#   moe_pages_tile_kb_1row 96 -> 128 (128 KB gate/up items where 96 gives 64): b1 8K 3.013-3.025 -> 2.854-2.862
#     (-5.3%), 1K -5.2%, 32K -5.3% (on the H100 +0.2% at 8K, +0.6% at 128K);
#   o_workers_after_2row 48 -> 16: b2 8K 4.339-4.357 -> 4.225-4.233 (-2.6%), b2 1K -4.0%, b2 128K even (on the
#     H100 +3.0%: the H100 calls 16-18 of the same directory).
# H100 (calls 24-29 of the same directory, 013f63c / ced9d5c, one process per call): 2048-key attention splits from
# three rows instead of sixteen (wider_split_batch 16 -> 3): b3 8K 6.058-6.065 -> 5.876-5.882 ms (-3.0%), b3 32K
# -5.3%, b4 -1.0% (32K -2.0%), b5 -1.0%, b6 -1.7%, b7 -1.1%, b8 -1.0% (32K -2.1%), b9 -0.4%, b10-b14 -0.7 to
# -1.0%; from two rows b2 was +2.5%. Not measured on the H200, nor at 3-15 rows beyond 32K.
CARD_TUNING: tuple[tuple[str, dict[str, int]], ...] = (
    ("NVIDIA H200", {"moe_pages_tile_kb": 512, "moe_pages_tile_kb_1row": 128, "o_workers_after_2row": 16}),
    ("NVIDIA H100 80GB HBM3", {"wider_split_batch": 3}),
)


# Per card, the kernel's build switches (build.KERNEL_SWITCHES names) that measured better there than the defaults:
# build.switch_flags applies them under $MEGAKERNEL_KERNEL_DEFINES once the backend has selected its card
# (build.select_card_switches), so a card without a row, the simulator and the CPU tests build the defaults.
# $MEGAKERNEL_CARD_SWITCHES=0 leaves the table out (A/Bs against the plain default build on that card).
# H200, 32 KB ring pages with two computing warps each (MK_PAGE_BYTES=32768, MK_PG_PAGE_WARPS=2): its one-row workers
# stream 22-24 GB/s per SM where its HBM needs ~30, and half the copies per byte raise that. Measured at 0b4d428 on an
# H200 (results/speed_20261207s41 calls 5, 6 and 8; each build in its own process, twice, under the row above), ms
# default / this: b1 8K 2.882, 2.874 / 2.840, 2.788 (-1.5, -3.0%), 1K 2.729, 2.726 / 2.690, 2.679 (-1.5%), 32K
# 3.163, 3.171 / 3.088, 3.095 (-2.4%), 128K 4.059, 4.053 / 4.073, 4.093 (+0.4, +1.0%), b2 4.276, 4.272 / 4.183, 4.187
# (-2.1%), b4 6.092, 6.097 / 6.019, 6.026 (-1.2%), b8 9.303, 9.304 / 9.169, 9.136 (-1.6%), b16 14.911, 14.892 / 14.592,
# 14.556 (-2.2%); the sweeps of both builds in one call (call 6): b1 256K 5.266 / 5.384 (+2.2%), the rest as above.
# test_gpu.py (33), memcheck (one row) and racecheck (2 and 16 rows) pass under it there (calls 6, 7). On the H100 it
# was even at b1 8K, +1.0% at 1K, -0.5% at b8 and b16 (speed_20261207s38 call 5).
# H100, the routed experts' 2 MB regions touched into L2 by the block that routed the layer (MK_PG_TLB_WARM=3).
# Measured at 068a941 on an H100 (results/speed_20261207s43 calls 1-4; each build in its own process, five times at
# b1 8K and 1K, ms default / this): b1 8K 3.276-3.285 / 3.250-3.262 (-0.7%), 1K 3.096-3.108 / 3.066-3.076 (-0.9%), 32K
# 3.603-3.613 / 3.574-3.583 (-0.8%), 128K 4.598-4.613 / 4.563-4.565 (-0.9%), b2 -0.1%, b4 -0.2%, b8 -0.2%, b16 even;
# test_gpu.py (33), memcheck (one row) and racecheck (2 and 16 rows) pass under it (calls 2-3). Not measured on the
# H200, whose row it is not in.
CARD_SWITCHES: tuple[tuple[str, dict[str, int]], ...] = (
    ("NVIDIA H200", {"MK_PAGE_BYTES": 32768, "MK_PG_PAGE_WARPS": 2}),
    ("NVIDIA H100 80GB HBM3", {"MK_PG_TLB_WARM": 3}),
)


def card_switches(device_name: str) -> dict[str, int]:
    """The build switches for a card named `device_name` (torch.cuda.get_device_name); {} for cards not in the table
    or where $MEGAKERNEL_CARD_SWITCHES=0."""
    if os.environ.get("MEGAKERNEL_CARD_SWITCHES", "1").strip() == "0":
        return {}
    for key, switches in CARD_SWITCHES:
        if key == device_name.strip():
            return dict(switches)
    return {}


def select_card_build(device_name: str) -> dict[str, int]:
    """This process's kernel builds start from the card's build switches (card_switches, through
    build.select_card_switches): call it before the first build.load, as the backend and the peak measurement do, so
    the plans' layouts and the loaded library agree. Returns the switches."""
    switches = card_switches(device_name)
    build.select_card_switches(switches)
    return switches


def card_tuning(device_name: str) -> dict[str, int]:
    """The plan overrides for a card named `device_name` (torch.cuda.get_device_name); {} for cards not in the
    table (the plan's defaults)."""
    for key, knobs in CARD_TUNING:
        if key == device_name.strip():
            bad = set(knobs) - set(TUNING_KEYS)
            if bad:
                raise ValueError(f"CARD_TUNING[{key!r}]: unknown keys {sorted(bad)}")
            return dict(knobs)
    return {}


def tuning_from_env() -> dict[str, int]:
    """Plan overrides for measurements: MEGAKERNEL_MK_TUNING="split_tokens=256,n_workers=100" (keys: TUNING_KEYS)."""
    text = os.environ.get("MEGAKERNEL_MK_TUNING", "").strip()
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, val = item.partition("=")
        if key not in TUNING_KEYS or not val.strip().isdigit():
            raise ValueError(f"MEGAKERNEL_MK_TUNING: bad item {item!r} (want KEY=INT, KEY in {', '.join(TUNING_KEYS)})")
        out[key] = int(val)
    return out
