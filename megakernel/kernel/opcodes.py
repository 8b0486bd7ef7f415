"""Single source of truth shared by the host (schedule builder, simulator, backend) and the CUDA kernel.

Everything the kernel needs to agree on with Python is declared here once: task opcodes, the task record
layout, the control block, the kernel parameter slots, the per-layer info and weight-pointer tables, the route
buffer layout and the compile-time constants. `generate_header()` turns them into `mk_generated.h`, which the
CUDA sources include; the build hashes that text, so a change here always rebuilds the kernel.
"""

from __future__ import annotations

import os
from enum import IntEnum

# ---- compile-time constants -----------------------------------------------------------------------------------
# Blocks per SM: 1 (default), or 2, the experiment MEGAKERNEL_BLOCKS_PER_SM=2 (read once, at import, so the host's
# layouts and the kernel built from this module agree): two blocks of 256 threads and half the shared memory per SM,
# so the hardware interleaves one block's claims, inputs, GEMV and signals with the other's weight loads (a 16-warp
# block's GEMV core is latency-bound: SPEED_NOTES.md, eighth session). Every constant below that depends on it says
# so; the backend launches BLOCKS_PER_SM x SMs blocks and checks that all of them are resident (schedule.py's
# no-deadlock argument). On the H200 its tiny parity tests pass and b1 8K ran ~15% slower than one block (c5079d3;
# SPEED_NOTES.md).
BLOCKS_PER_SM = int(os.environ.get("MEGAKERNEL_BLOCKS_PER_SM", "1"))
if BLOCKS_PER_SM not in (1, 2):
    raise ValueError(f"MEGAKERNEL_BLOCKS_PER_SM must be 1 or 2, got {BLOCKS_PER_SM}")
NUM_THREADS = 512 // BLOCKS_PER_SM   # threads per block (16 warps at one block per SM)
NUM_WARPS = NUM_THREADS // 32
MAX_BATCH = 16 // BLOCKS_PER_SM      # rows per decode step the kernel supports (the LM head keeps row b's maximum in
                                     # warp b; at two blocks per SM the inputs of 16 rows would not fit either)
WTILE_BYTES = 128 * 1024     # bytes of weights one GEMV task stages in shared memory, at most (the plan lowers
                             # it for an inner size whose input rows would not fit beside it: plan.gemv_tiles)
ROW_PAD = 0                  # elements after every GEMV weight and input row in shared memory. 32 (a pitch of 64 mod
                             # 128 bytes) frees the tensor-core GEMV's fragment loads of 2-way bank conflicts but needs
                             # one bulk copy per row: measured slower (b1 8K +0.2 ms, b8 +1.4 ms) than contiguous tiles
GEMV_RED_FLOATS = NUM_WARPS * 16 * MAX_BATCH   # the tensor-core GEMV's per-warp partial sums (16 rows x the batch)
GEMV_SCRATCH_BYTES = (GEMV_RED_FLOATS + 64 * MAX_BATCH) * 4   # partial sums and the output [64][MAX_BATCH] f32
MAX_TILE_ROWS = 64           # rows of one GEMV tile at most (bounds the reduction scratch)
# The paged MoE worker (ModelPlan.moe_pages, csrc/mk_moe_pages.cuh): a ring of PAGE_BYTES pages that one loader warp
# fills with the worker's items' weight rows as pages free, and the other warps compute a page each (or half a page:
# the MK_PG_PAGE_WARPS build switch), so the SM keeps
# loading across item boundaries. At most PAGE_MAX pages, PAGE_SLOTS items in flight (each with its input row and its
# outputs), at most PAGE_ROWS_MAX weight rows per page (a computing warp's accumulators); its barriers and bookkeeping
# (PgState, csrc/mk_pg_sync.cuh) take PAGE_STATE_BYTES of the plan's dynamic shared memory, not static memory every
# plan would pay for.
PAGE_BYTES = 16384           # a ring page and one bulk copy: the default of the MK_PAGE_BYTES build switch (build.py;
                             # the plan's layout reads the build's value, build.page_bytes)
PAGE_MAX = 16
PAGE_WARPS = 1               # computing warps per ring page: the default of the MK_PG_PAGE_WARPS build switch (1 or 2)
PAGE_SLOTS = 3               # items in flight: the default of the MK_PAGE_SLOTS build switch (build.py; the plan's
                             # layout reads the build's value, build.page_slots)
PAGE_ROWS_MAX = 16
PAGE_STATE_BYTES = 2048
PAGE_ITEM_ROWS_MAX = 128     # rows of one paged expert item in all halves at most (moe_pages_tile_kb; its outputs)
PAGE_ITEM_PAGES_MAX = 256    # pages of one paged item at most
PAGE_OUT_ARRIVALS = 32 * PAGE_ITEM_PAGES_MAX   # the count of an item slot's "pages computed" mbarrier: every lane of
                             # a page's computing warp arrives (each releases its own output stores), the loader the
                             # rest when it publishes the item
# keys per shared-memory chunk in attention: one 16-key slice per computing warp (two stages of 128 keys, ~140 KB,
# would not fit half an SM's shared memory). The experiment MEGAKERNEL_ATTN_CHUNK=64 (read at import) halves the
# chunks at one block per SM, so a ring of 4 (MEGAKERNEL_ATTN_MAX_STAGES=4) takes today's shared memory with 3
# chunks (96 KB) in flight instead of 1 (64 KB): the b1 trace has a 512-key split at ~14 GB/s per SM, its next
# chunk's load outstanding alone while it waits
ATTN_CHUNK = int(os.environ.get("MEGAKERNEL_ATTN_CHUNK", str(128 // BLOCKS_PER_SM)))
if ATTN_CHUNK not in (64, 128) or ATTN_CHUNK * BLOCKS_PER_SM > 128:
    raise ValueError(f"MEGAKERNEL_ATTN_CHUNK must be 64 or 128 (64 at two blocks per SM), got {ATTN_CHUNK}")
ATTN_WARPS = ATTN_CHUNK // 16  # warps that run attention's tensor-core math (the others help load)
# chunks of K/V in the attention ring, at most (the step's value: attn_stages). 2 by default; the experiment
# MEGAKERNEL_ATTN_MAX_STAGES=3 (read at import, like BLOCKS_PER_SM) builds a ring of three, so attn_stages=3 can be timed
# against 2 in one process. At 3 the default build's persistent loop does not spill (the attention of 8 rows spills
# 84 bytes, 68 at 2), the MK_TOPK_PACKED=0 build's spills 24 (2ec61ba); the ring takes 206 KB at North dims.
ATTN_MAX_STAGES = int(os.environ.get("MEGAKERNEL_ATTN_MAX_STAGES", "2"))
if ATTN_MAX_STAGES not in (2, 3, 4):
    raise ValueError(f"MEGAKERNEL_ATTN_MAX_STAGES must be 2, 3 or 4, got {ATTN_MAX_STAGES}")
DEFAULT_ATTN_STAGES = 2
ATTN_MAX_GROUP = 8           # query heads per kv head the attention's 16-row MMA tile serves (rows 8-15 pad)
ATTN_MAX_HEAD_DIM = 128      # head_dim of the tensor-core attention, at most (a multiple of 16)
ATTN_ROW_PAD = 8             # elements after each K and V row (and, MK_ATTN_PAD=1, Q row) in an attention split's
                             # shared memory: rows 16 bytes off a multiple of 128 read without bank conflicts
ATTN_MERGE_PAD = 8           # floats after each row of an attention split's merge (MK_ATTN_PAD=1): its float2
                             # stores one wavefront per half-warp (csrc/mk_attn_layout.cuh)
ATTN_OUT_PER_THREAD = 4      # (query heads per kv head) * head_dim <= NUM_THREADS * this
ATTN_TABLE_SLOTS = 512       # KV blocks of one attention split at most: attention reads their block-table entries
                             # into shared memory up front (step_inputs checks a step's splits fit)
MAX_HEAD_DIM = 256
MAX_GROUP = 16               # query heads per kv head
MAX_EXPERTS = 256
MAX_TOPK = 16
MAX_PAIRS = MAX_BATCH * MAX_TOPK            # (row, expert) pairs of one step's routing, at most
MAX_SLOTS = MAX_PAIRS                       # queue slots of one layer, at most (a slot holds at least one pair)
SMEM_LIMIT = 227 * 1024 if BLOCKS_PER_SM == 1 else 113 * 1024   # shared memory one block may use on sm_90 (228 KB
                             # per SM, 1 KB of it reserved per resident block)
SMEM_RESERVE = 3072          # of SMEM_LIMIT, left to the kernel's static shared memory (records, stamps, row pointers,
                             # the MoE worker's route cache of MK_MOE_LOCAL; test_build checks the build's own figure)
PREFETCH_MIN_TILE = 48 * 1024 // BLOCKS_PER_SM  # a plan double-buffers its GEMV weights (the next task's tile loads
                             # while this one waits and computes) only where two tiles of at least this many bytes fit
TILE_ROW_QUANTUM = 8 // BLOCKS_PER_SM  # tile_kb's tiles are multiples of this many rows (4: 12-row gate/up halves,
                             # 96 KB, fit half an SM's shared memory where 8 would leave 64 KB)
SWZ_ALIGN = 1024             # a 128-byte-swizzled tensor copy's destination starts at a shared address aligned to
                             # this (MK_ATTN_BULK=2's KV chunks; benchmarks/gemv_stream.cu's swizzled tiles)
SWZ_X_PAD = 32               # benchmarks/gemv_stream.cu: elements after each input row of a swizzled tile (K + 32:
                             # the 8 input rows of an MMA fragment in different banks)
TMAP_BYTES = 128             # one CUtensorMap
DEFAULT_SPLIT_TOKENS = 512   # keys per attention split (rounded to the KV block size)
MAX_SPLITS_PER_HEAD = 256    # longer contexts get longer splits
DN_LAG_MIN = 12              # a MoE queue's down-item lag (ModelPlan.dn_lag) is at most half the step's expert slots,
                             # and 0 where that is under this many slots: H100, 02f69ca + the cap, one process, lag 8
                             # at b2 (~16 slots) 4.872-4.896 ms against 4.716-4.732 at 0; ~12 at b3 6.010-6.016 /
                             # 6.039-6.060 (mk_moe.cuh queue_kind, simulator.queue_kind)
# ModelPlan.l2_prefetch's bits: what a layer's QKV tile prefetches into L2 (cp.async.bulk.prefetch.L2, no shared
# memory, nothing waits on it) while the layer's routing leaves HBM idle
L2PF_OPROJ = 1               # its share of the layer's O-projection weights (read ~40 us later, after attention)
L2PF_NEXT_QKV = 2            # its own rows of the next layer's QKV weights (read one layer later)
L2PF_EVICT_LAST = 4          # the prefetched lines with priority evict_last (else evict_normal); weights stream
                             # evict_first, so either outlives them
L2PF_AFTER_GEMV = 32         # with 1 or 2: the QKV tile prefetches after its GEMV (the routing window, when the
                             # layer's QKV copies have landed) instead of beside its own weights' issue (their window)
L2PF_NEXT_INPUTS = 16        # (each paged worker's loader, at its first down item) this layer's residual rows h and
                             # the next layer's norm weights: the next layer's fused norms read h ~45 us after it
                             # was written, and the b1 traces put the fused norms' inputs 5-6 us after their wait

# ---- opcodes --------------------------------------------------------------------------------------------------


class Op(IntEnum):
    NORM = 1          # residual add (+ MoE combine) and norm of one row; layer 0 gathers the embedding;
                      # layer == num_layers is the final norm
    QKV = 2           # tile of the fused QKV projection, RoPE, q to scratch and K/V appended to the paged cache
    ATTN = 3          # one split of decode attention for one (sequence, kv head): partial output + log-sum-exp
    ATTN_COMBINE = 4  # merge the splits of one (sequence, kv head)
    OPROJ = 5         # tile of the output projection
    ROUTER = 6        # tile of the router logits
    TOPK = 7          # top-k + scores for every row of one layer, builds the layer's expert queue
    MOE_WORKER = 8    # claims expert work items (gate/up tiles, then down tiles) from the layer's queue
    MLP_GU = 9        # tile of the dense / shared-expert gate+up projection with SiLU*up
    MLP_DOWN = 10     # tile of the dense / shared-expert down projection
    LM_HEAD = 11      # tile of the LM head (logits and a per-tile argmax)
    ARGMAX = 12       # greedy token per row from the per-tile maxima


# ---- task record: REC_INTS int32 per task ------------------------------------------------------------------------
# a0..a3 meaning per opcode:
#   NORM         a0=row
#   QKV/OPROJ/ROUTER/MLP_GU/MLP_DOWN   a0=first row of the tile, a1=rows (MLP_GU: rows of gate and of up each)
#   ATTN         a0=seq, a1=kv head, a2=split index, a3=first partial slot of this (seq, kv head)
#   ATTN_COMBINE a0=seq, a1=kv head * combine_parts + part, a2=number of splits, a3=first partial slot
#   TOPK         a0=moe layer index
#   MOE_WORKER   a0=moe layer index
#   LM_HEAD      a0=first row, a1=rows, a2=index of its maxima, a3=rows per tile of a streaming run (0: one tile)
#   ARGMAX       a0=number of LM-head tiles
# sig: counter incremented (release) when the task is done (-1: none). Waits: (counter, target) pairs, -1 unused.
REC_FIELDS = ("op", "layer", "a0", "a1", "a2", "a3", "sig", "w0c", "w0t", "w1c", "w1t", "w2c", "w2t",
              "flags", "pad1", "pad2")
REC_INTS = len(REC_FIELDS)
MAX_WAITS = 3
# flags of a QKV / ROUTER / MLP_GU record (the `fused_norm` plan knob): the tile computes its own input rows (the
# residual and the layer's norm) instead of waiting for NORM tasks; one QKV tile writes the residual rows h for the
# next layer and one ROUTER tile the normed rows x the MoE items read.
FLAG_FUSED_NORM, FLAG_WRITE_H, FLAG_WRITE_X = 1, 2, 4
# a static GEMV record that issues its weights only once its input rows are read (the `qkv_late_weights` plan knob:
# the QKV tiles' copies then do not land while the router tiles read the same residual, the head of the b1 chain)
FLAG_LATE_WEIGHTS = 8
R = {name: i for i, name in enumerate(REC_FIELDS)}

# ---- control block (int32, zeroed before every step together with the counters) --------------------------------
CTRL_FIELDS = ("ticket", "abort", "err_code", "err_task", "err_counter", "err_value", "err_target", "err_block",
               "done_blocks", "pad1", "pad2", "pad3", "pad4", "pad5", "pad6", "pad7")
CTRL_INTS = len(CTRL_FIELDS)
ERR_WATCHDOG = 1
ERR_BAD_OPCODE = 2
ERR_SMEM = 3          # a task's shared-memory layout needs more than the launch gave (err_value / err_target)
ERR_STALL = 4         # a wait inside a block (the paged MoE worker's pages, slots, barriers) passed the watchdog:
                      # err_value names it (STALL_WAITS, in order: MK_STALL_PAGE ...), err_target its sequence
STALL_WAITS = {"PAGE": "a page's copy", "EMPTY": "a ring page to free", "SLOT": "an item slot to free",
               "ITEM": "an item's description", "INPUT": "an item's input row", "CLAIM": "an item's input (late claim)",
               "OUTS": "an item's pages' outputs"}

# ---- kernel parameters: NUM_PARAMS int64 slots passed by value ----------------------------------------------------
PARAM_FIELDS = (
    # task list and synchronisation
    "tasks", "n_tasks", "ctrl", "counters", "n_counters", "moe_work",
    # tables
    "layer_info", "wptrs", "inv_freq",
    # global weights
    "embed", "final_norm", "lm_head",
    # paged KV cache (up to 2 groups)
    "kv0", "kv1", "nblk0", "nblk1",
    # per-step inputs (int32): ids[B], pos[B], table offset[B*G], table base block[B*G]; block tables (int32)
    "step", "tables",
    # scratch
    "h", "x", "q", "attn", "part_o", "part_lse", "ao", "rlog", "route", "eact", "y", "mact", "mout",
    "logits", "lm_best", "tokens",
    # dims
    "B", "Bm", "H", "n_heads", "n_kv", "head_dim", "E", "topk", "I", "I_mlp", "V", "L", "n_groups",
    # n_heads x head_dim (the attention output's width), given so the kernel need not keep the product in a register
    "q_dim",
    # a number that changes whenever the launch's layer_info / wptrs tables may differ from the last launch's (one per
    # backend): the MK_CONST_TABLES build copies them to constant memory when it changes (host side only)
    "tables_version",
    "block_size", "split_tokens", "attn_stages",
    # 1: attention splits run two warps per 16-key slice, each half the head dims (ModelPlan.attn_dsplit_rows; builds
    # with MK_ATTN_DSPLIT=1, else ignored)
    "attn_dsplit",
    # L2 prefetches (ModelPlan.l2_prefetch; bits L2PF_*): by a layer's QKV tiles, the slice of the layer's O weights
    # (and of the next layer's QKV weights) proportional to the tile's rows; by the paged workers, the next layer's
    # residual inputs
    "l2_pf",
    # counters of the per-slot expert gate/up items: layer * cpl + c_gu + slot
    "cpl", "c_gu",
    # expert work items
    "gu_rows", "gu_tiles", "dn_rows", "dn_tiles", "n_slots", "n_pairs",
    # bytes of each of the two GEMV weight buffers (0: one buffer, the inputs right after the tile; no prefetch)
    "wbuf",
    # bytes of each of the expert items' two weight buffers (the warp-specialised worker's ring; 0: none)
    "moe_wbuf",
    # bytes of each of the streaming LM head's two weight buffers (plan.ModelPlan.lm_wbuf; 0: one task per tile)
    "lm_wbuf",
    # 1: a block claims its next ticket when it starts a task; 0: once the task has signalled (ModelPlan.claim_ahead)
    "claim_ahead",
    # 1: a MoE worker with one weight buffer issues its next item's claim and uses the answer only after this item's
    # GEMV (ModelPlan.moe_claim_late); 0: it waits for the answer before the item's dependency wait
    "moe_claim_late",
    # 1: TOPK lays out a queue of at most 32 pairs in one warp, without block barriers (ModelPlan.topk_warp)
    "topk_warp",
    # O-projection tiles in each MoE layer's work queue (the `o_queue` knob; 0: static OPROJ tasks), the eighths of
    # the down items queued ahead of them (ModelPlan.o_after), their rows, and the per-layer offset of the
    # attention-combine counter they wait on
    "o_items", "o_after", "o_rows", "c_comb",
    # > 0: the down items of expert slot s follow the gate/up items of slot s + dn_lag in the queue
    # (ModelPlan.queue_dn_lag; csrc/mk_moe.cuh queue_kind, simulator.queue_kind)
    "dn_lag",
    # > 0: an expert's pairs in queue slots of at most this many (ModelPlan.slot_pairs; csrc/mk_routing.cuh)
    "slot_pairs",
    # attention-combine tasks per (row, kv head), each over a part of its query heads (ModelPlan.combine_parts)
    "combine_parts",
    # 1: no TOPK tasks; every MoE worker routes its layer itself (ModelPlan.worker_topk)
    "worker_topk",
    # the paged MoE worker's layout (ModelPlan.moe_pages; pg_n = 0: the plain worker): pages at byte 0, then
    # MK_PAGE_SLOTS input buffers of pg_in_bytes from pg_in_off (a down or O item's input rows), then MK_PAGE_SLOTS x
    # pg_rows x pg_out_rows fp32 outputs from pg_out_off, then the layer's x rows (pg_rows x H bf16, the gate/up
    # items' inputs; none where pg_x_item: each gate/up item's own x rows in its input buffer) from pg_x_off, then
    # its PgState (PAGE_STATE_BYTES) at pg_state_off; pg_rows: the input rows it holds per item (the plan's
    # tile_batch, or slot_pairs); pg_claim_late: its loader claims the next item only once this item's inputs are
    # loaded (ModelPlan.moe_pages_claim_late)
    "pg_n", "pg_in_off", "pg_in_bytes", "pg_out_off", "pg_out_rows", "pg_state_off", "pg_claim_late", "pg_rows",
    "pg_x_off", "pg_x_item",
    # 1: the paged worker sets up its barriers before its wait for the routing, not after (ModelPlan.moe_pages_early)
    "pg_early",
    # route buffer layout (int32 offsets inside one MoE layer's route record)
    "r_stride", "r_slot_expert", "r_slot_start", "r_slot_cnt", "r_pair_row", "r_pair_rank", "r_pair_w",
    "r_topk_ids",
    # numerics
    "norm_type", "norm_eps", "logit_scale", "attn_scale", "sel_fn", "norm_topk", "shared_comb",
    # watchdog
    "watchdog_ns",
    # profiling build only (0 otherwise): task records [n_tasks][PROF_INTS], MoE item records
    # [Lm][prof_items_per_layer][PROF_INTS], per-block clock calibration [grid][PROF_BLOCK_INTS] (all int64)
    "prof", "prof_items", "prof_items_per_layer", "prof_blocks",
    # attention's K/V tensor maps (MK_ATTN_BULK=2): one per KV group, TMAP_BYTES each, or 0
    "kv_tmaps",
    # 1: a TOPK task runs a dry pass of its routing (the previous MoE layer's, into shared memory) before its wait, so
    # its real pass runs from a warm instruction cache (ModelPlan.topk_warm)
    "topk_warm",
    # 1: a MoE worker claims its first item before its wait for the routing (ModelPlan.worker_claim_early)
    "worker_claim_early",
)
NUM_PARAMS = len(PARAM_FIELDS)
P = {name: i for i, name in enumerate(PARAM_FIELDS)}

# ---- profiling build (compiled with -DMK_PROFILE=1; see kernel/timeline.py) --------------------------------------
# One record per executed task (at its ticket) and per MoE work item. Stamps are %globaltimer (ns, one time base on
# every SM); the per-block (globaltimer, stamp) pairs at the block's start and end map stamps to ns (the identity
# for these stamps; records of the older clock64 builds still map through them). claim: the block starts the task; issued: its weight (or K/V) loads are issued;
# waited: its dependency wait is over; landed: its weights and inputs are in shared memory; computed: the GEMV core
# is done (projections and MoE items; = end for tasks without one), so computed -> end is the epilogue and the
# signal; end: its work is done, taken just before it signals its counter (so a consumer's `waited` can never
# precede a producer's `end`).
# m0..m3: optional marks inside a task kind's work (-1: not taken), named per kind in PROF_MARKS, in the order the
# kind takes them: they split its time after `waited` into phases (kernel/timeline.py `phases`).
PROF_STAMPS = ("claim", "issued", "waited", "landed", "computed", "end")
PROF_MARK_FIELDS = ("m0", "m1", "m2", "m3")
PROF_FIELDS = ("block", "sm", "op", "layer", "arg") + PROF_STAMPS + PROF_MARK_FIELDS
PROF_INTS = len(PROF_FIELDS)
PROF_BLOCK_FIELDS = ("g_start", "c_start", "g_end", "c_end", "timer_step_ns", "sm")
PROF_BLOCK_INTS = len(PROF_BLOCK_FIELDS)
PROF_ITEM_GU, PROF_ITEM_DN, PROF_ITEM_O = 100, 101, 102   # pseudo-opcodes of MoE work items (gate/up tile, down
                                                         # tile, O-projection tile in the queue)
# What each mark of a task kind means (the phase that ends at it); kinds without an entry take none.
_FUSED_MARKS = ("inputs ready (fused: residual and norm; serial 4: its second pass)",
                "serial 1: layer tables read / 2: every source read / 3: ao row read / 4: first pass done",
                "serial 1: h row read / 3: mo row read / 4: first GEMV done",
                "serial 1: norm weights read / 3: the expert rows y read")
PROF_MARKS = {
    "NORM": ("residual loaded and summed", "normed and stored"),
    "TOPK": ("logits loaded (row 0's first max)", "experts chosen", "queue slots written", "pairs written"),
    # (marks 1-3 in MK_FUSED_SERIAL profiling builds only, mk_norm.cuh: at 1 and 3 sources read one after another,
    # at 2 mark 1 when the normal loads have all arrived)
    "ROUTER": _FUSED_MARKS,
    "QKV": _FUSED_MARKS,
    "ATTN_COMBINE": ("log-sum-exps read", "split weights computed", "partials merged (thread 0)",
                     "a second, warm pass (MK_REPEAT_SMALL=2)"),
    "MOE_GATE_UP": ("next item claimed", "next tile issued (two buffers)", "inputs loaded"),
    "MOE_DOWN": ("next item claimed", "next tile issued (two buffers)", "inputs loaded"),
    # (the paged worker only: where its time goes before its first item and after its closing barrier)
    "MOE_WORKER": ("paged worker entered", "its barriers set up", "its first item decoded (loader)",
                   "every role done (closing barrier)"),
}

# ---- per-layer info (int32) and weight pointers (int64) ------------------------------------------------------------
LAYER_INFO_FIELDS = ("uses_rope", "group", "lig", "window", "moe_idx", "mlp_kind", "mlp_width", "pad")
LAYER_INFO_INTS = len(LAYER_INFO_FIELDS)
MLP_NONE, MLP_DENSE, MLP_SHARED = 0, 1, 2          # mlp_kind: the static SwiGLU of the layer, if any

WPTR_FIELDS = ("norm", "qkv", "qkv_bias", "o", "o_bias", "mlp_gu", "mlp_down", "router", "e_gu", "e_down")
WPTR_INTS = len(WPTR_FIELDS)
# the MK_CONST_TABLES build's constant-memory copy of both tables holds this many layers (the backend refuses more)
MAX_TABLE_LAYERS = 256

NORM_RMS, NORM_LAYER = 0, 1
SEL_SIGMOID, SEL_SOFTMAX = 0, 1
COMB_SUM, COMB_AVERAGE = 0, 1


def _defines(prefix: str, names, upper: bool = True) -> list[str]:
    return [f"#define {prefix}{n.upper() if upper else n} {i}" for i, n in enumerate(names)]


def generate_header() -> str:
    """The C header with every shared constant. Included by csrc/*.cu; part of the build hash."""
    lines = ["// GENERATED by megakernel/kernel/opcodes.py: do not edit.", "#pragma once", ""]
    consts = dict(BLOCKS_PER_SM=BLOCKS_PER_SM, NUM_THREADS=NUM_THREADS, NUM_WARPS=NUM_WARPS, MAX_BATCH=MAX_BATCH,
                  WTILE_BYTES=WTILE_BYTES,
                  MAX_TILE_ROWS=MAX_TILE_ROWS, PAGE_MAX=PAGE_MAX,
                  PAGE_ROWS_MAX=PAGE_ROWS_MAX, PAGE_STATE_BYTES=PAGE_STATE_BYTES, PAGE_OUT_ARRIVALS=PAGE_OUT_ARRIVALS, PAGE_ITEM_PAGES_MAX=PAGE_ITEM_PAGES_MAX, GEMV_SCRATCH_BYTES=GEMV_SCRATCH_BYTES, ROW_PAD=ROW_PAD,
                  GEMV_RED_FLOATS=GEMV_RED_FLOATS,
                  ATTN_CHUNK=ATTN_CHUNK, ATTN_WARPS=ATTN_WARPS, ATTN_MAX_STAGES=ATTN_MAX_STAGES,
                  ATTN_MAX_GROUP=ATTN_MAX_GROUP, ATTN_MAX_HEAD_DIM=ATTN_MAX_HEAD_DIM, ATTN_OUT_PER_THREAD=ATTN_OUT_PER_THREAD,
                  ATTN_TABLE_SLOTS=ATTN_TABLE_SLOTS, ATTN_ROW_PAD=ATTN_ROW_PAD,
                  ATTN_MERGE_PAD=ATTN_MERGE_PAD,
                  MAX_HEAD_DIM=MAX_HEAD_DIM, MAX_GROUP=MAX_GROUP, MAX_EXPERTS=MAX_EXPERTS, MAX_TOPK=MAX_TOPK,
                  MAX_PAIRS=MAX_PAIRS, MAX_SLOTS=MAX_SLOTS, SMEM_RESERVE=SMEM_RESERVE,
                  SWZ_ALIGN=SWZ_ALIGN, SWZ_X_PAD=SWZ_X_PAD, TMAP_BYTES=TMAP_BYTES,
                  REC_INTS=REC_INTS, MAX_WAITS=MAX_WAITS, CTRL_INTS=CTRL_INTS, NUM_PARAMS=NUM_PARAMS,
                  LAYER_INFO_INTS=LAYER_INFO_INTS, WPTR_INTS=WPTR_INTS, MAX_TABLE_LAYERS=MAX_TABLE_LAYERS,
                  ERR_WATCHDOG=ERR_WATCHDOG, ERR_BAD_OPCODE=ERR_BAD_OPCODE, ERR_SMEM=ERR_SMEM, ERR_STALL=ERR_STALL,
                  FLAG_FUSED_NORM=FLAG_FUSED_NORM, FLAG_WRITE_H=FLAG_WRITE_H, FLAG_WRITE_X=FLAG_WRITE_X,
                  FLAG_LATE_WEIGHTS=FLAG_LATE_WEIGHTS,
                  MLP_NONE=MLP_NONE, MLP_DENSE=MLP_DENSE, MLP_SHARED=MLP_SHARED,
                  NORM_RMS=NORM_RMS, NORM_LAYER=NORM_LAYER, SEL_SIGMOID=SEL_SIGMOID, SEL_SOFTMAX=SEL_SOFTMAX,
                  COMB_SUM=COMB_SUM, COMB_AVERAGE=COMB_AVERAGE, PROF_INTS=PROF_INTS, PROF_N_STAMPS=len(PROF_STAMPS),
                  PROF_N_MARKS=len(PROF_MARK_FIELDS),
                  PROF_BLOCK_INTS=PROF_BLOCK_INTS, PROF_ITEM_GU=PROF_ITEM_GU, PROF_ITEM_DN=PROF_ITEM_DN, PROF_ITEM_O=PROF_ITEM_O,
                  DN_LAG_MIN=DN_LAG_MIN, L2PF_OPROJ=L2PF_OPROJ, L2PF_NEXT_QKV=L2PF_NEXT_QKV, L2PF_EVICT_LAST=L2PF_EVICT_LAST,
                  L2PF_NEXT_INPUTS=L2PF_NEXT_INPUTS, L2PF_AFTER_GEMV=L2PF_AFTER_GEMV)
    lines += [f"#define MK_{k} {v}" for k, v in consts.items()]
    # build switches' defaults (a -DMK_PAGE_SLOTS=N or -DMK_PAGE_BYTES=N flag sets them; the plan lays out the same)
    lines += ["#ifndef MK_PAGE_SLOTS", f"#define MK_PAGE_SLOTS {PAGE_SLOTS}", "#endif"]
    lines += ["#ifndef MK_PAGE_BYTES", f"#define MK_PAGE_BYTES {PAGE_BYTES}", "#endif"]
    lines += ["#ifndef MK_PG_PAGE_WARPS", f"#define MK_PG_PAGE_WARPS {PAGE_WARPS}", "#endif"]
    lines.append("")
    lines += [f"#define OP_{op.name} {int(op)}" for op in Op]
    lines.append("")
    lines += _defines("RF_", REC_FIELDS)
    lines.append("")
    lines += _defines("CTRL_", CTRL_FIELDS)
    lines.append("")
    lines += _defines("PRM_", PARAM_FIELDS, upper=False)   # used as PRM_##name
    lines.append("")
    lines += _defines("LI_", LAYER_INFO_FIELDS)
    lines.append("")
    lines += _defines("WP_", WPTR_FIELDS)
    lines.append("")
    lines += _defines("PF_", PROF_FIELDS)
    lines.append("")
    lines += _defines("PS_", PROF_STAMPS)
    lines.append("")
    lines += _defines("PB_", PROF_BLOCK_FIELDS)
    lines.append("")
    lines += _defines("STALL_", list(STALL_WAITS))
    lines.append("")
    return "\n".join(lines) + "\n"
