"""The static plan of a model on the decode megakernel: its GEMV tiles, shared-memory layouts, scratch, counters and
tuning knobs (ModelPlan), the plans a backend launches by batch size (tiling_plans) and the one a launch runs
(plan_for_rows). schedule.py builds each step's task list from a plan."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megakernel.config import ModelConfig
from megakernel.kernel import opcodes as O
from megakernel.kernel.build import page_bytes, page_slots, page_warps
from megakernel.kv.cache import KVLayout


WAVE_SPLIT_MAX = 1024   # keys per split at most where split_waves lengthens one: longer splits measured slower than
                        # their waves predict (b1 229K, 1408 keys against 1024: +0.2% where the waves said -1.8%; 256K,
                        # 2048 against 1152: +5.8% where they said +1.6%; speed_20261206s31 calls 15, 17, 18)
MIN_SHORT_SPLIT = 256   # keys per attention split at least where `short_splits` narrows them (what was measured)


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def tile_rows(K: int, halves: int = 1, elt: int = 2, max_batch: int = O.MAX_BATCH, wbuf: int = 0,
              tile_kb: int = 0) -> int:
    """Rows (per half) of one GEMV weight tile of inner size K: at most MAX_TILE_ROWS rows in all halves together.
    One weight buffer (wbuf == 0): a power of two, at most WTILE_BYTES of weights, less where the task's max_batch
    input rows of K elements would not fit beside them (the kernel stages the inputs right after the tile); with
    tile_kb > 0, at most tile_kb KiB instead and a multiple of TILE_ROW_QUANTUM rows (the plan knob `tile_kb`: a
    192 KB gate/up tile is 24 rows per half, which no power of two gives). Two buffers of wbuf bytes (the
    prefetching layout, inputs after both): as many rows as fill one buffer."""
    row = elt * (K + O.ROW_PAD)              # rows are padded in shared memory (opcodes.ROW_PAD)
    if wbuf:
        return max(1, min(O.MAX_TILE_ROWS // halves, wbuf // (row * halves)))
    cap = tile_kb * 1024 if tile_kb else O.WTILE_BYTES
    budget = min(cap + O.MAX_TILE_ROWS * elt * O.ROW_PAD,
                 O.SMEM_LIMIT - O.SMEM_RESERVE - O.GEMV_SCRATCH_BYTES - max_batch * row)
    fit = budget // (row * halves)
    q = O.TILE_ROW_QUANTUM
    rounded = fit // q * q if tile_kb and fit >= q else _pow2_floor(fit)
    return max(1, min(O.MAX_TILE_ROWS // halves, rounded))


def split_fits_table(split_tokens: int, block_size: int) -> bool:
    """Whether an attention split of split_tokens keys over block_size-token KV blocks spans at most
    ATTN_TABLE_SLOTS blocks (the entries the kernel's attention reads into shared memory; a split not aligned to
    the blocks touches two more)."""
    return split_tokens // block_size + 2 <= O.ATTN_TABLE_SLOTS


def paged_item_rows(K: int, halves: int, kb: int, elt: int = 2) -> int:
    """Rows (per half) of a paged plan's expert item of inner size K under moe_pages_tile_kb = kb: at most kb KiB of
    weights in all halves, a multiple of TILE_ROW_QUANTUM rows, at most PAGE_ITEM_ROWS_MAX rows in all halves."""
    fit = kb * 1024 // (elt * K * halves)
    q = O.TILE_ROW_QUANTUM
    return max(1, min(O.PAGE_ITEM_ROWS_MAX // halves, fit // q * q if fit >= q else fit))


def prefetch_wbuf(k_max: int, max_batch: int, extra: int = 0, elt: int = 2) -> int:
    """Bytes of each of the two GEMV weight buffers of the prefetching layout (scratch | buffer 0 | buffer 1 |
    max_batch input rows of up to k_max elements | extra), or 0 where two buffers of PREFETCH_MIN_TILE do not fit."""
    free = O.SMEM_LIMIT - O.SMEM_RESERVE - O.GEMV_SCRATCH_BYTES - max_batch * (k_max + O.ROW_PAD) * elt - extra
    wbuf = min(O.WTILE_BYTES, free // 2) // 16 * 16
    return wbuf if wbuf >= O.PREFETCH_MIN_TILE else 0


def gemv_smem_bytes(K: int, rows: int, max_batch: int, elt: int = 2) -> int:
    """Shared memory of one GEMV task in the one-buffer layout (csrc/mk_gemv.cuh, `task_gemv`): reduction and
    output scratch, the tile's `rows` weight rows (all halves), then max_batch input rows."""
    return O.GEMV_SCRATCH_BYTES + (rows + max_batch) * (K + O.ROW_PAD) * elt


def attn_smem_bytes(d: int, g: int) -> int:
    """Shared memory of one ATTN task (`task_attn`): a ring of ATTN_MAX_STAGES chunks of K and of V (rows padded by
    ATTN_ROW_PAD elements), q in bf16 and the split's block-table entries; after the key loop the ring holds each
    computing warp's partial output (rows of d + ATTN_MERGE_PAD floats), max and sum. Q's and the merge's rows are
    padded only in MK_ATTN_PAD=1 builds; every build reserves the padded sizes."""
    ring = (O.ATTN_MAX_STAGES * 2 * O.ATTN_CHUNK * (d + O.ATTN_ROW_PAD) * 2 + g * (d + O.ATTN_ROW_PAD) * 2
            + O.ATTN_TABLE_SLOTS * 4)
    merge = O.ATTN_WARPS * g * (d + O.ATTN_MERGE_PAD) * 4 + 2 * O.ATTN_WARPS * O.ATTN_MAX_GROUP * 4
    return max(ring, merge)


def route_scratch_bytes(E: int) -> int:
    """Shared memory of TOPK's routing scratch (csrc/mk_routing.cuh topk_scratch_bytes) for the largest batch."""
    e32 = (E + 31) // 32 * 32
    return (O.MAX_BATCH * e32 + 2 * O.MAX_BATCH * O.MAX_TOPK + e32 + O.MAX_BATCH * e32 // 32 + 2 * e32 // 32) * 4


def fused_norm_smem_bytes(H: int) -> int:
    """Shared memory a `fused_norm` tile needs beyond its GEMV layout: none where the kernel keeps each row's residual
    in registers (8 columns per thread, H <= 8 * NUM_THREADS, builds with MK_SMALL_VEC >= 2: csrc/mk_gemv.cuh
    FUSED_NORM_IN_REGS), else the residual row in fp32 and a block sum's scratch after the input rows."""
    return 0 if H % 8 == 0 and H <= 8 * O.NUM_THREADS else (H + O.NUM_WARPS) * 4


def small_task_smem_bytes(E: int, H: int) -> int:
    """Shared memory of the task kinds that prefetch the next GEMV tile into weight buffer 1 while they run (NORM,
    TOPK, ATTN_COMBINE: csrc/mk_kernel.cu): the largest of their layouts."""
    combine = 2 * O.MAX_GROUP * 4 + O.MAX_SPLITS_PER_HEAD * O.MAX_GROUP * 4 + O.NUM_THREADS * 4  # (parts' sums)
    route = route_scratch_bytes(E)
    norm = H * 4 + 64 * 4
    return max(combine, route, norm)


def smem_bytes(gemv_tiles: list[tuple[int, int]], Bm: int, d: int, g: int, E: int, H: int, wbuf: int = 0,
               k_max: int = 0) -> int:
    """Dynamic shared memory of the kernel: the max over its task kinds. gemv_tiles: (K, rows in all halves) of
    every GEMV kind the plan uses; wbuf > 0: the prefetching layout (two weight buffers, Bm rows of k_max after)."""
    if wbuf:
        gemv = O.GEMV_SCRATCH_BYTES + 2 * wbuf + Bm * (k_max + O.ROW_PAD) * 2
    else:
        gemv = max(gemv_smem_bytes(K, rows, Bm) for K, rows in gemv_tiles)
    return int(max(gemv, attn_smem_bytes(d, g), small_task_smem_bytes(E, H)))


def lm_runs(vocab: int, rows: int, blocks: int, min_tiles: int = 4) -> list[tuple[int, int]]:
    """(first row, rows) of every LM-head task. blocks == 0: one task per tile of `rows`. Otherwise runs of tiles
    for `blocks` blocks claiming them in order, largest first (guided self-scheduling: each run is 2/3 of an even
    share of what is left, at least min_tiles): few tasks, so few pipeline restarts, and small ones at the end, so
    the blocks finish together."""
    tiles = math.ceil(vocab / rows)
    out: list[tuple[int, int]] = []
    t = 0
    while t < tiles:
        n = 1 if not blocks else min(tiles - t, max(min_tiles, math.ceil(2 * (tiles - t) / (3 * blocks))))
        out.append((t * rows, min(n * rows, vocab - t * rows)))
        t += n
    return out


@dataclass
class ModelPlan:
    """Everything about a (model, KV layout, max batch) that does not change from step to step."""

    cfg: ModelConfig
    layout: KVLayout
    max_batch: int
    n_workers: int = 132                 # MOE_WORKER tasks per MoE layer (the grid size on the GPU)
    split_tokens: int | None = None      # keys per attention split (None: DEFAULT_SPLIT_TOKENS, grown for long ctx)
    wide_split_batch: int = 4            # steps of at least this many rows split attention at 2 x DEFAULT_SPLIT_TOKENS
                                         # (0: never): with 16+ (row, kv head) pairs, fewer, longer splits cost less
                                         # SM time. 8K, ms at 0 / 4 (838fd59): b4 9.495 / 9.315, b8 15.62 / 15.12,
                                         # b16 26.12 / 25.11; 1024-key splits at b1: 4.68 vs 4.17 (d00cb4d)
    wider_split_batch: int = 16          # steps of at least this many rows split attention at 4 x DEFAULT_SPLIT_TOKENS
                                         # (0: never; whatever wide_split_batch says; KV blocks so small that such
                                         # a split's blocks outgrow ATTN_TABLE_SLOTS, 4 tokens, keep the wide size):
                                         # at 16 rows 2048-key splits put one wave of splits (128) on the sliding
                                         # layers instead of two. 8K, ms at 1024 / 2048-key splits
                                         # (6f6d235, one process each): b16 18.767 / 18.387 and 18.715 / 18.329,
                                         # b12 15.567 / 15.926, b10 13.694 / 14.175, b8 11.345 / 11.584
    split_align: int = 128               # a long context's grown splits (over MAX_SPLITS_PER_HEAD default splits)
                                         # are rounded up to a multiple of this many keys: whole ATTN_CHUNKs. At 64
                                         # they could end in half a chunk (576 keys at 128K, 1088 at 256K: 4.5 and
                                         # 8.5 chunks), whose last chunk runs half its warps. b1, ms at 64 / 128
                                         # (d310dc8, one process): 256K 8.155, 8.141 / 7.890, 7.894; 128K 5.837,
                                         # 5.822 / 5.824, 5.809
    split_waves: int = 1                 # 1: a long context's grown split (over MAX_SPLITS_PER_HEAD default splits)
                                         # is the multiple of split_align from the smallest that fits the cap up to
                                         # WAVE_SPLIT_MAX keys that gives a full layer's splits the fewest
                                         # key-waves over n_workers blocks, ceil(splits / n_workers) x keys (ties:
                                         # the shorter); 0: the smallest. b1, ms at 640 / 768 / 1024-key splits,
                                         # 128K (one process, H200): 4.238 / 4.156 / 4.017-4.029; 256K at 1152 /
                                         # 1280 / 1536 / 2048: 5.220 / 5.392 / 5.509 / 5.523 (speed_20261206s31
                                         # calls 12-15). 0 / 1 on an H100 (call 18, without the cap): b1 128K
                                         # 4.774-4.782 / 4.595 (-3.8%), 160K -3.0%, 192K -0.9%, b2 128K -2.0%; 229K
                                         # +0.2% (1408-key splits) and 256K even (1152 either way)
    short_splits: int = 4                # steps of one row whose longest range is under this many default splits
                                         # split it into this many (of >= MIN_SHORT_SPLIT keys, multiples of 64) (0:
                                         # never): at 1K a layer's attention is otherwise 2 long splits per kv head
                                         # on the critical path. b1 1K, ms at 512 / 256 keys (a30e0a5, one
                                         # process): 3.257-3.261 / 3.094; 8K 3.416 / 3.437, 32K 3.884 / 4.042
    attn_stages: int = O.DEFAULT_ATTN_STAGES   # K/V chunks in the attention ring (2..ATTN_MAX_STAGES)
    attn_dsplit_rows: int = 2            # steps of at most this many rows run attention with two warps per 16-key
                                         # slice, each half the head dims (the MK_ATTN_DSPLIT=1 build's variant: no
                                         # spills at head_dim 128, but every slice's scores computed twice). 8K, ms
                                         # with /
                                         # without it (c22d611, builds in their own processes): b1 3.239-3.244 /
                                         # 3.266-3.269, 128K 5.539-5.542 / 5.565-5.572; b8 11.357-11.361 /
                                         # 11.272-11.277, b16 18.549-18.556 / 18.315-18.328. At dc645ff (one
                                         # process, at 1 / 0 / 16 rows): b1 3.258-3.263 / 3.292 / 3.258, b2
                                         # 4.894-4.900 / 4.895 / 4.862, b8 11.371-11.382 / 11.389 / 11.485, b16
                                         # 18.487-18.509 / 18.489 / 18.742, 128K 5.607-5.617 / 5.612 / 5.612
    oproj_first: int = 0                 # 1: each layer's O-projection tiles listed ahead of its MoE workers
    o_workers_after: int = 16            # MoE layers whose O projection is static tasks (plans of more rows than
                                         # o_queue): this many of the layer's workers listed after its O tiles, the
                                         # rest ahead of them, so the blocks that leave attention last run the O
                                         # projection inside the MoE phase while the first ones stream experts (0:
                                         # every worker first, the O tiles at the layer's tail; n_workers or more:
                                         # the O tiles first, as oproj_first orders MoE layers). The b16 trace
                                         # (session 28, H100) had the O tiles after every worker: the layer's last
                                         # ~37 us, HBM at ~20%. H100, MK_LOADX_ASYNC=1, one process, ms at 0 / 8 /
                                         # 16 / 24 / 48 (session 29): b16 17.96 / 17.57 / 17.44 / 17.50 / 17.74,
                                         # b12 15.24 / 14.94 / 14.72 / 14.78 / 14.99, b6 9.35 / 9.27 / 9.24 / 9.26
                                         # / 9.35, b3 6.09 / 6.04 / 5.99 / 5.95 / 6.06
    o_workers_after_2row: int = 48       # the same for plans of at most 2 rows (tile_batch), whose MoE phase is too
                                         # short for 16 blocks to run the 128 O tiles inside it: b2 ms at 0 / 16 /
                                         # 32 / 48 / 60 (session 29, as above) 4.92-4.95 / 4.86-4.87 / 4.77-4.78 /
                                         # 4.73 (twice) / 4.82
    qkv_by_head: int = 1                 # 1: QKV tiles listed kv head by head (its K, V, then Q tiles), not Q, K, V
                                         # (with claim_ahead=0 measured b1 8K 4.09 vs 4.16 ms, b8 14.90 vs 15.28)
    qkv_fill_rows: int = 1               # plans of at most this many rows (tile_batch) cut their QKV tiles as large
                                         # as the tile budget allows (48 rows at 1-3, 40 at 4-11), each kv head's
                                         # Q, K and V rows into near-equal tiles (schedule.qkv_tiles); larger plans
                                         # (0: all) keep a row count dividing head_dim (32 there). The b1 8K trace
                                         # at 63e8d4d: 160 tiles of 32 rows, ~123 claimed before the layer's input
                                         # is ready and 37 at ~8.7 us, whose weights land at ~14 us, so the last kv
                                         # head's attention waited to ~19 us; at 48 rows 112 tiles, one per block
                                         # (its attention from ~12 us), but the routing chain's L2 reads slow under
                                         # the larger tiles' copies (TOPK ends 13.8 us instead of 11.8). H100, one
                                         # process, 16 / 0 (session 30): b1 8K 3.273-3.285 / 3.293-3.294 ms, 1K
                                         # 3.124-3.125 / 3.154-3.155, 128K 4.836-4.841 / 4.853-4.855; b2 4.797-4.800
                                         # / 4.769-4.775, b3 6.099-6.130 / 6.129-6.132, b8 11.330-11.334 /
                                         # 11.266-11.267, b10 13.155-13.171 / 13.185-13.188
    qkv_late_weights: int = 0            # plans of at most this many rows (tile_batch) issue their QKV tiles'
                                         # weights only once the tile's input rows are read (FLAG_LATE_WEIGHTS),
                                         # not at the claim. The b1 trace at 02f69ca's tiling: the router tiles'
                                         # fused norm (their L2 reads of the residual) takes ~4.5 us while 112 QKV
                                         # tiles' 192 KB copies land, ~3.7 with the 32-row tiles' smaller first
                                         # wave; the router -> top-k chain is the b1 critical path and the QKV
                                         # tiles are not (attention ends ~7 us before the O items start). Needs
                                         # the build switch MK_LATE_WEIGHTS=1 (the flag is ignored otherwise).
                                         # 0: off. Measured slower (H100, speed_20261206s31 call 1, in that
                                         # build): b1 8K 3.438-3.447 / 3.300-3.317 ms at 1 / 0 (+4.2%), 1K +3.9%,
                                         # 32K +3.8%: the QKV tiles then hold their SMs ~4 us longer
    fused_norm: int = 1                  # steps of at most this many rows skip the per-row NORM tasks of layers >= 1:
                                         # QKV / router / MLP gate-up tiles normalise their own inputs (in registers:
                                         # fused_norm_smem_bytes). 8K, ms at 0 / 4 (804f4cb, one process): b1
                                         # 3.546-3.557 / 3.501, b1 32K 4.026-4.030 / 3.980, b2 5.205 / 5.308,
                                         # b4 8.542 / 8.971: every tile's residual costs more than the NORM hop
                                         # from 2 rows
    fused_qkv: int = 1                   # with fused_norm, 1: the QKV tiles normalise their own rows too; 0: only the
                                         # router tiles do (on the routing's critical path), and a NORM task per row
                                         # writes x and h for the QKV tiles and the MoE items: ~160 QKV tiles per
                                         # layer then read x (4 KB) instead of recomputing the residual (~44 KB of L2
                                         # reads each, ~4 us per tile at b1, tl_b1_e1222bb). 0 measured slower
                                         # (sessions 30 and 33, H100: b1 8K +0.5%, +0.4%; with 9 readers instead
                                         # of ~120 the router's inputs arrived no sooner)
    tile_batch: int = 0                  # rows the GEMV tiles leave room for (0: max_batch); launches of at most
                                         # this many rows may use the larger tiles (the backend's `batch_tiles`)
    o_queue: int = 1                     # plans of at most this many rows (tile_batch) make each MoE layer's
                                         # O-projection tiles items of its expert queue (after the gate/up items
                                         # and `o_after` eighths of the down items) instead of static tasks listed
                                         # after the workers, which only free blocks claim (0: none). 8K, ms at
                                         # o_queue 0 / 1 / 4 / 16 (01168ec): b1 3.862 / 3.763 / 3.780 / 3.794,
                                         # b2 5.701 / 5.705 / 5.600 / 5.638, b4 8.980 / 8.975 / 8.945 / 8.971;
                                         # b8 14.73 (0) vs 14.82 (16) at 8786382. 1 since session 16: the 2..4-row
                                         # plans are paged (moe_pages_from) and their queued O items' inputs left
                                         # the ring 6 pages; with static O tasks (c6a71af, one process) b2 5.111 /
                                         # 5.274, b3 6.483 / 6.777, b4 7.987 / 8.633 against o_queue=4 plain
    worker_topk: int = 0                 # 1: no TOPK task; every MoE worker waits on the router tiles and routes the
                                         # layer itself (the same code, into its shared memory): the router ->
                                         # top-k -> workers hand-off, ~8 us per layer at batch 1, loses a hop.
                                         # Needs MK_MOE_LOCAL=1 (default). Not yet measured
    worker_claim_early: int = 0          # 1: a MoE worker claims its first item before its wait for the routing
                                         # (thread 0's atomic in flight while it waits, its result read after), not
                                         # with the route's loads after it: the b1 trace put ~2.4 us between a
                                         # paged worker's wait and its first item's claim stamp, the claim being an
                                         # atomic on the layer's one queue counter that ~130 workers hit at once
                                         # when TOPK signals. Not with worker_topk. H100, session 32, one process:
                                         # even at b1 1K-32K, b8, b16 (b1 8K 3.275-3.276 vs 3.273-3.288 ms)
    router_topk: int = 0                 # 1: no TOPK task; the router tile that completes its layer's router
                                         # counter (an acq_rel add tells which) routes the layer and signals the
                                         # top-k counter the workers wait on: one dependency hop (~1.5-2 us) less.
                                         # b1 8K 4.140 vs 4.167 ms (d00cb4d), 3.850 vs 3.857 (838fd59); b4-b16
                                         # unchanged: off
    combine_parts: int = 1               # each (row, kv head)'s attention combine as this many tasks, each over
                                         # group / combine_parts of its query heads (a divisor of the group): a
                                         # combine of 256 splits (128K+ contexts) reads ~1 MB, on one SM at 1.
                                         # Not yet measured
    slot_pairs: int = 4                  # > 0: an expert's pairs go in queue slots of at most this many (an
                                         # expert with more gets several slots, its weights read once per slot),
                                         # and a paged plan's item slots hold this many input rows, not tile_batch
                                         # (unless it queues O items, whose inputs are every row): smaller item
                                         # slots leave the ring more pages (the 16-row plan 8 at 4, 4 without; the
                                         # 4..8-row plan 10, 8 without; most experts get 1-2 of 128 pairs at b16,
                                         # uniform routing). 8K ms at 0 / 4 / 2 with moe_pages=16 (ee2de36, one
                                         # process): b4 7.894 / 7.639 / 7.707, b6 10.409 / 10.063 / 10.135, b8
                                         # 12.456 / 12.000 / 12.145, b12 19.573 / 17.230 / 17.372, b16 23.654 /
                                         # 20.799 / 21.412 (8: b16 22.840, b8 12.454); b2 equal. 0: off
    dn_lag: int = 32                     # > 0: a MoE layer's queue puts the down items of expert slot s right
                                         # after the gate/up items of slot s + dn_lag (slots past the last: after
                                         # every gate/up item, in slot order), so down items stream while later
                                         # experts' gate/up items still load instead of all at the layer's end
                                         # (the b8 trace at 5b5e58b: gate/up items 65-179 us, down 160-239 us of
                                         # a 261 us layer); every item's dependencies stay earlier in the queue.
                                         # 0: every down item after every gate/up item. Paged plans only, and
                                         # without queued O items (queue_dn_lag). 8K ms at 0 / 4 / 8 / 16 / 32
                                         # (810432c, one process): b8 12.689 / 13.239 / 12.729 / 12.578 / 12.609
                                         # (again 12.665 / 12.563 at 0 / 16), b4 8.035 / 8.284 / 8.091 / 7.963 /
                                         # 8.047 (8.045 / 7.972); the plain worker at b16 23.556 / 23.604 at 0 / 16.
                                         # A lag under ~16 slots (~400 items, what 132 workers hold in flight)
                                         # makes down items wait on gate/up items still loading. 32 since session
                                         # 30 (the O tiles now inside the MoE phase; H100, 63e8d4d, one process,
                                         # 16 / 24 / 32 / 48 / 64): b16 17.434-17.445 / 17.370 / 17.372-17.383 /
                                         # 17.376 / 17.383, b8 11.207-11.211 / 11.158 / 11.157-11.159 / 11.163 /
                                         # 11.171, b2 4.752-4.775 / 4.743 / 4.733-4.745 / 4.737 / 4.736; 8: b8
                                         # 11.420, b16 17.667; b1 even. The kernel caps the lag at half the
                                         # step's slots and drops one under opcodes.DN_LAG_MIN (32 had put
                                         # every down item last at b4, ~30 slots; the cap's 8 at b2 was +3%):
                                         # against lag 0, b3 -0.3%, b4 -0.5%, b8 / b16 -0.1%, b2 even
    o_after: int = 8                     # 0..8: eighths of a layer's down items queued ahead of its O items
                                         # (o_queue; 0: right after the gate/up items, where a worker that claims
                                         # one may wait for the combines; 8: after every down item). 8 since
                                         # session 19 (07a390d, one process): b1 8K 3.219 / 3.283 at 8 / 6, 1K
                                         # 2.919 / 2.950, 128K 5.519 / 5.623, 4 no better than 6. Earlier, b1 8K:
                                         # 3.838 / 3.804 / 3.797 / 3.819 ms at 0 / 2 / 4 / 8 (8786382); with
                                         # fused_norm (6df2330, one process) 3.499-3.512 / 3.434 / 3.445 / 3.451
                                         # at 4 / 6 / 7 / 8, 32K 3.962-3.975 / 3.913, b2 5.242 / 5.254, b4
                                         # 8.600-8.617 / 8.615
    o_item_kb: int = 0                   # > 0: plans that queue their O projection (o_queue) cut it into items of
                                         # at most this many KiB instead of GEMV tiles (192 KB at North dims: 86
                                         # items, which at b1 run on 86 of the 132 workers at the layer's tail);
                                         # plans with static O tasks, into tasks of at most this many KiB (a
                                         # multiple of TILE_ROW_QUANTUM rows). Session 27: at b8 the 128 O tasks of
                                         # 128 KB are the layer's tail, one per SM after the MoE workers, ~14 us
                                         # from claim to end (load 5, GEMV 4.3); two of 64 KB per SM would overlap
                                         # the second's load with the first's GEMV. Measured (H100, 3dd709f's
                                         # defaults, one process) at 64: b8 +3.1%, b2 +4.6%, b1 +0.9%, b16 even
                                         # (its O tasks are 64 KB already): each task's claim, wait, epilogue and
                                         # signal come twice. Stays 0
    router_first: int = 1                # 1: each MoE layer's router tiles listed ahead of its QKV tiles (0: after)
    moe_ring: int = 0                    # plans of at most this many rows (tile_batch) give the expert items a
                                         # ring of two weight buffers of their own (tiles sized to fill one; the
                                         # static tasks keep one large buffer), which the plain worker
                                         # double-buffers its items in; 0: none
    router_tile_rows: int = 16           # rows of a router tile at most (0: as many as fill a weight tile): smaller
                                         # tiles spread the router over more blocks, which end sooner (16: b1 8K
                                         # 4.14 vs 4.20 ms in one process, b8 equal; SPEED_NOTES.md)
    lm_stream: int = 1                   # 1: the LM head as a few hundred streaming tasks, each a run of tiles
                                         # double-buffered inside the task (lm_wbuf), sizes decreasing toward the
                                         # end of the list; 0: one task per 128 KB tile
    claim_ahead: int = 0                 # 1: a block claims its next ticket as it starts a task (the claim's
                                         # latency hidden); 0: after the task signalled, so no ticket waits behind
                                         # another task's dependency wait (measured b1 8K 4.16 vs 4.55 ms, b8 15.28
                                         # vs 15.78); prefetching plans always claim ahead
    moe_claim_late: int = 0              # 1: a MoE worker with one weight buffer issues the claim of its next item
                                         # where it does today but reads the answer only after this item's GEMV
                                         # (the atomic's round trip off the item's path; the items still run in
                                         # claim order); 0: it waits for the answer first. Not yet measured
    topk_warp: int = 1                   # 1: TOPK lays out an expert queue of <= 32 pairs (batch x top-k) in one
                                         # warp (a bitonic sort of the pairs) instead of three block-wide phases
                                         # (b1 8K 4.167 vs 4.228 ms, b2 6.127 vs 6.168, one process, d00cb4d)
    tile_kb: int = 192                   # > 0: one-buffer GEMV tiles (static tasks and expert items) of up to this
                                         # many KiB in multiples of TILE_ROW_QUANTUM rows, not WTILE_BYTES in powers
                                         # of two: at North dims 24-row gate/up tiles at <= 3 rows, 24-row O tiles at
                                         # 1 (a third fewer items, each paying a claim, its inputs and a signal
                                         # once); 0: the old tiles. 8K, ms at 0 / 192 (646056b): b1 3.791 / 3.683, b2 5.633 /
                                         # 5.419; b1 32K 4.261 / 4.151, 128K 6.091 / 6.002
    moe_pages: int = 16                  # plans of moe_pages_from..moe_pages rows (tile_batch) run their MoE items
                                         # on the paged worker (csrc/mk_moe_pages.cuh): one loader warp streams the
                                         # items' weight rows into a ring of PAGE_BYTES pages as pages free, the
                                         # other warps compute a page each, so the SM never stops loading at an item
                                         # boundary (the plain worker loads nothing for ~3.5 of a gate/up item's 8
                                         # us at b1). Same items, same claim order. 8K, ms plain / paged (0dd4d9a,
                                         # dea16fa; one process each): b8 14.00 / 13.68 (-2.3%), b1 3.503 / 3.54,
                                         # b2 5.304 / 5.40, b4 8.66 / 10.24 (its O items' 32 KB inputs leave 6
                                         # pages), b16 slower still (4 pages; 23.5 / 36.7 ms with 16); at 8: b5
                                         # -2.6%, b6 -2.3%; with the mbarrier hand-offs (8ef1d76) b8 13.39 /
                                         # 13.98 (-4.2%); at ba1f07c (one process) b8 13.42 / 13.97, b6 11.06 /
                                         # 11.60, b1-b4 and b16 unchanged (plain plans), racecheck clean at 6 rows
                                         # and at 1 (moe_pages=1,moe_pages_from=1): 8 the default since session 16;
                                         # 16 since session 17, with slot_pairs=4 (the 9..16-row plans were +56%
                                         # paged with 16-row item slots: 4 pages; with 4-row slots 8 pages, b16
                                         # -12% against the plain worker, ee2de36)
    moe_pages_from: int = 1              # the fewest rows (tile_batch) of a paged plan (1: every plan up to moe_pages).
                                         # 2 in sessions 16-17 (with o_queue=1: above): one row was even or slower
                                         # paged (8K 3.457 plain / 3.490 paged, 128K 5.938 / 5.825: c6a71af; 3.333
                                         # / 3.342 at 6f6d235); 1 since session 18 with 128 KB one-row items
                                         # (moe_pages_tile_kb_1row)
    moe_pages_tile_kb: int = 256         # > 0: a paged plan's expert items of up to this many KiB (paged_item_rows),
                                         # not capped by the plain worker's shared-memory formula (at 8 rows of
                                         # input that formula gives 16-row gate/up halves: 128 KB items, 31 items
                                         # per worker per b8 layer, each paying an epilogue and a signal). 8K, ms
                                         # at 0 / 256, one process (c832144, tensor-core pages): b5 9.458 / 9.340,
                                         # b6 10.692 / 10.585, b7 11.818 / 11.733, b8 12.733 / 12.641
    moe_pages_tile_kb_1row: int = 96     # > 0: a one-row paged plan's items of up to this many KiB instead of
                                         # moe_pages_tile_kb's (0: that knob's; moe_pages_tile_kb=0, the plain
                                         # worker's sizes, applies to every plan). One row, ms at 6f6d235 (one
                                         # process; the plain worker's 192 KB items / paged 256 / 192 / 128 / 96 /
                                         # 64): 8K 3.311 / 3.342 / 3.328 / 3.262-3.271 / 3.347 / 3.426; 1K 3.023 /
                                         # - / 3.000 / 2.943 / 3.065; 128K 5.543 / - / 5.641 / 5.568 / 5.539. Two
                                         # and four rows keep 256 (128: b2 4.934 / 4.874, b4 7.456 / 7.236).
                                         # 96 since session 30 (64 KB gate/up items, 8 rows a half, and 96 KB
                                         # down items of 64 rows, where 128 gives 128 and 120 KB). H100, one
                                         # process (63e8d4d with qkv_fill_rows), 128 / 96 / 112 / 80 / 64 / 160 /
                                         # 192: 8K 3.268-3.280 / 3.263-3.268 / 3.268 / 3.319 / 3.336 / 3.304 /
                                         # 3.368; 1K 3.121-3.125 / 3.093-3.096 / 3.107 / 3.154 / 3.169 / 3.145 /
                                         # 3.369; 128K 4.836-4.847 / 4.823-4.825 / 4.840 / 4.851 / 4.844
    moe_tile_kb: int = 0                 # > 0: the expert items' tiles (gate/up, down) of up to this many KiB
                                         # instead of tile_kb's (0). For the paged worker: at 64 a gate/up item is
                                         # 2 x 8 rows of 2048, 4 pages, so its ring of 12 holds three items (its
                                         # item slots), not one, and the layer's tail is cut finer; at 128, 2 x 16
                                         # rows, 8 pages. Not yet measured
    moe_pages_early: int = 1             # 1: the paged worker sets up its barriers before it waits for TOPK (the
                                         # b1 trace had ~0.5 us of set-up between the wait and the first item):
                                         # b1 8K 3.265 against 3.271-3.288, 1K 2.935 / 2.947-2.952, 128K, b8 and
                                         # b16 even (75d732c, one process)
    l2_prefetch: int = 0                 # bits of opcodes.L2PF_*: a layer's QKV tiles prefetch into L2 their share
                                         # of the layer's O weights (1) and/or their rows of the next layer's QKV
                                         # (2), evict_last with 4, after the tile's GEMV (the routing window)
                                         # instead of beside its weights' issue with 32; with 16, each paged
                                         # worker prefetches, at its
                                         # first down item, the layer's residual rows and the next layer's norm
                                         # weights (16 / 20, session 33 call 1, H100: b1 8K and 1K even, b8 and
                                         # b16 within 0.2%: those lines are L2 hits anyway; TOPK's prefetch of the
                                         # next router and norm weights, bit 8 in session 32, measured even at
                                         # b1-b16 and was removed).
                                         # At b1 the routing chain (~11 us a layer) leaves HBM mostly idle while
                                         # the O weights are read at the layer's end
    topk_warm: int = 1                   # 1: TOPK runs a dry pass of the previous MoE layer's routing (into shared
                                         # memory) before its wait: its real pass then runs from a warm instruction
                                         # cache (b1 trace with MK_REPEAT_SMALL=2: a cold pass ~5 us after the wait,
                                         # a warm one ~2.9). 31f1f61, one process, 0 / 1: b1 8K 3.132-3.141 /
                                         # 3.111-3.119, 1K 2.848-2.850 / 2.826-2.828, b8 and b16 even
    moe_pages_claim_late: int = 0        # 1: the paged worker's loader claims its next item after this item's
                                         # pages are issued and its input row is loaded (its dependency met), not
                                         # before its last page: no item held behind a down item that waits on its
                                         # counter (the layer's tail), at the price of the next item's weights not
                                         # streaming into free pages during that wait. Not yet measured
    moe_pages_max: int = 0               # > 0: the paged worker's ring has at most this many pages (tests: fewer
                                         # pages than computing warps, so pages and end markers wrap the ring)
    moe_pages_x_item: int = 1            # 1: a paged plan whose ring then keeps more pages loads each gate/up item's
                                         # x rows into its item slot (as a down item's activations), not every row
                                         # of x once per worker (64 KB at 16 rows, which held the 16-row plan to 8
                                         # pages where per-item rows leave 10); 0: never; 2: always (tests: tiny
                                         # dims fill the ring either way). 8K ms at 1 / 0 / 2 (c1085b3, one
                                         # process): b16 20.150 / 20.798 / 20.145, b12 16.729 / 17.257 / 16.734,
                                         # b10 14.650 / 14.787 / 14.649; b8 12.058 / 12.024 / 12.100 (the 4..9-row
                                         # plan keeps the shared rows at 1)
    workers_early: int = 0               # MoE layers whose O projection is static tasks (more rows than o_queue):
                                         # this many of the layer's n_workers listed right after its QKV tiles,
                                         # ahead of its attention splits, so experts stream while the other blocks
                                         # run attention (b8 8K trace at 0dd4d9a: the workers start ~58 us into a
                                         # ~275 us layer, once every attention split is claimed; 0: all after the
                                         # combines)
    prefetch: int = 0                    # 1: two GEMV weight buffers where they fit (prefetch_wbuf): each block
                                         # issues its next task's tile before it waits for and computes this one
                                         # (measured slower so far: SPEED_NOTES.md)

    def __post_init__(self) -> None:
        cfg = self.cfg
        if not 1 <= self.max_batch <= O.MAX_BATCH:
            raise ValueError(f"max_batch must be in 1..{O.MAX_BATCH}, got {self.max_batch}")
        if self.router_topk and self.worker_topk:
            raise ValueError("router_topk and worker_topk both replace the TOPK task: pick one")
        self.L = cfg.num_layers
        self.H, self.Q, self.KV = cfg.hidden_size, cfg.q_size, cfg.kv_size
        self.d, self.nh, self.nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.g = self.nh // self.nkv
        self.moe_layers = [l for l in range(self.L) if cfg.is_moe(l)]
        self.moe_idx = {l: i for i, l in enumerate(self.moe_layers)}
        self.Lm = len(self.moe_layers)
        self.E, self.topk = cfg.num_experts, cfg.num_experts_per_tok
        self.I = cfg.moe_intermediate_size
        self.shared_width = cfg.moe_intermediate_size * cfg.num_shared_experts
        self.mlp_kind = []
        self.mlp_width = []
        for l in range(self.L):
            if not cfg.is_moe(l):
                self.mlp_kind.append(O.MLP_DENSE)
                self.mlp_width.append(cfg.dense_intermediate_size)
            elif cfg.num_shared_experts:
                self.mlp_kind.append(O.MLP_SHARED)
                self.mlp_width.append(self.shared_width)
            else:
                self.mlp_kind.append(O.MLP_NONE)
                self.mlp_width.append(0)
        self.I_mlp = max(self.mlp_width + [8])
        Bm = self.max_batch
        self.tb = self.tile_batch or Bm
        if not 1 <= self.tb <= Bm:
            raise ValueError(f"tile_batch {self.tile_batch} outside 1..max_batch ({Bm})")
        if self.o_workers_after < 0 or self.o_workers_after_2row < 0:
            raise ValueError("o_workers_after and o_workers_after_2row are counts of workers, >= 0")
        self.o_late_workers = self.o_workers_after_2row if self.tb <= 2 else self.o_workers_after
        if self.slot_pairs < 0:
            raise ValueError(f"slot_pairs is a count of pairs per queue slot, >= 0, got {self.slot_pairs}")
        # queue slots of a layer, at most: one per active expert, plus (slot_pairs) one per further slot_pairs of an
        # expert's pairs; never more than the pairs (a slot holds at least one)
        n_pairs = Bm * self.topk
        self.n_slots = min(self.E, n_pairs)
        if 0 < self.slot_pairs < Bm:
            self.n_slots = min(n_pairs, self.n_slots + n_pairs // self.slot_pairs)
        self.n_pairs = Bm * self.topk
        self.groups = self.layout.groups
        self.n_groups = len(self.groups)
        # tiles
        d = self.d
        self.k_max = max(self.H, self.Q, self.I, self.I_mlp)
        fused = fused_norm_smem_bytes(self.H) if self.fused_norm else 0   # the fused tiles' residual row
        self.wbuf = self._two_buffers(self.k_max, 2 * (self.k_max + O.ROW_PAD) * 2, fused) if self.prefetch else 0
        if self.wbuf:
            self.claim_ahead = 1             # the prefetch issues the next ticket's tile: it must know that ticket
        rows = lambda K, halves=1: tile_rows(K, halves, max_batch=self.tb, wbuf=self.wbuf, tile_kb=self.tile_kb)
        r = rows(self.H)
        fill = self.tb <= self.qkv_fill_rows
        while r > 1 and ((not fill and d % r) or r % 2):   # whole RoPE pairs (and, unless fill, a divisor of d)
            r -= 1
        self.qkv_rows = r
        self.o_rows = rows(self.Q)
        self.router_rows = min(rows(self.H), self.router_tile_rows or O.MAX_TILE_ROWS)
        self.mgu_rows = rows(self.H, 2)
        self.mdn_rows = {w: rows(w) for w in set(self.mlp_width) if w}
        # the expert items' buffers: the prefetching layout's, or (moe_ring) a ring of two inside the same memory
        # with the inputs of the plan's rows after it
        self.moe_wbuf = self.wbuf
        o_in_queue = self.tb <= self.o_queue                    # (whose items run on the plain worker)
        if self.o_item_kb:                   # O items (an even count of rows) or tasks of at most o_item_kb KiB
            cap_rows, q = self.o_item_kb * 1024 // (self.Q * 2), 2 if o_in_queue else O.TILE_ROW_QUANTUM
            self.o_rows = min(self.o_rows, max(q, cap_rows // q * q))
        if self.tb <= self.moe_ring and not self.wbuf and self.Lm and not o_in_queue:
            one_row = max(2 * (self.H + O.ROW_PAD) * 2, (self.I + O.ROW_PAD) * 2)   # a gate/up pair, a down row
            self.moe_wbuf = self._two_buffers(max(self.H, self.I), one_row, fused)
        mrows = lambda K, halves=1: tile_rows(K, halves, max_batch=self.tb, wbuf=self.moe_wbuf,
                                              tile_kb=self.moe_tile_kb or self.tile_kb)
        self.gu_rows = mrows(self.H, 2)
        self.dn_rows = mrows(self.I)
        self._page_layout(o_in_queue)
        # moe_pages_tile_kb: a paged plan's expert items sized by the knob alone (their weights stream through the
        # pages, never the GEMV buffer), kept only if the page layout still fits with them
        self.big_items = False
        kb = self.moe_pages_tile_kb
        if kb and self.tb == 1 and self.moe_pages_tile_kb_1row:
            kb = self.moe_pages_tile_kb_1row
        if self.pg_n and kb:
            plain = (self.gu_rows, self.dn_rows)
            self.gu_rows = paged_item_rows(self.H, 2, kb)
            self.dn_rows = paged_item_rows(self.I, 1, kb)
            self._page_layout(o_in_queue)
            self.big_items = self.pg_n > 0
            if not self.big_items:
                self.gu_rows, self.dn_rows = plain
                self._page_layout(o_in_queue)
        self.gu_tiles = math.ceil(self.I / self.gu_rows)
        self.dn_tiles = math.ceil(self.H / self.dn_rows)
        self.lm_rows = rows(self.H)
        # the streaming LM head: two buffers with tile_batch input rows after them (not with the prefetching layout,
        # whose buffer-1 prefetches the LM tasks' runs would overlap)
        self.lm_wbuf = prefetch_wbuf(self.H, self.tb) if self.lm_stream and not self.wbuf else 0
        if self.lm_wbuf:
            self.lm_rows = min(O.MAX_TILE_ROWS, self.lm_wbuf // ((self.H + O.ROW_PAD) * 2))
            if self.lm_rows < 1:
                self.lm_wbuf, self.lm_rows = 0, rows(self.H)
        # (K, rows in all halves) of every GEMV kind: the shared-memory size is derived from these
        self.lm_tile = (self.H, self.lm_rows)
        self.gemv_tiles = [(self.H, self.qkv_rows), (self.Q, self.o_rows), self.lm_tile]
        if not self.big_items:               # (the paged worker's own item sizes never use the GEMV buffer)
            self.gemv_tiles += [(self.H, 2 * self.gu_rows), (self.I, self.dn_rows)]
        if self.Lm:
            self.gemv_tiles.append((self.H, self.router_rows))
        if any(self.mlp_width):
            self.gemv_tiles.append((self.H, 2 * self.mgu_rows))
            self.gemv_tiles += [(w, r) for w, r in self.mdn_rows.items()]
        self.lm_runs = lm_runs(cfg.vocab_size, self.lm_rows, self.n_workers if self.lm_wbuf else 0)
        self.n_lm_tiles = len(self.lm_runs)          # LM-head tasks: one maximum per row each
        self.n_o_tiles = math.ceil(self.H / self.o_rows)
        self.o_items = self.n_o_tiles if o_in_queue and self.Lm else 0     # per MoE layer's queue
        # a MoE layer's workers listed ahead of its attention splits (workers_early, where its O projection is static
        # tasks), and of the others those listed ahead of its static O tiles: all but o_late_workers, none with
        # oproj_first (schedule.py lists them so)
        self.n_workers_early = min(self.workers_early, self.n_workers) if not self.o_items else 0
        n_late = self.n_workers - self.n_workers_early
        self.o_workers_ahead = 0 if self.oproj_first else n_late - min(n_late, self.o_late_workers)
        if self.combine_parts < 1 or self.g % self.combine_parts or \
                (self.combine_parts > 1 and self.g // self.combine_parts * self.d > O.NUM_THREADS):
            raise ValueError(f"combine_parts={self.combine_parts} must divide the {self.g} query heads per kv head, "
                             f"with at most {O.NUM_THREADS} outputs (heads x head_dim) per part")
        if not 0 <= self.o_after <= 8:
            raise ValueError(f"o_after is in eighths of the down items, 0..8, got {self.o_after}")
        if self.dn_lag < 0:
            raise ValueError(f"dn_lag is a count of expert slots, >= 0, got {self.dn_lag}")
        # (paged plans only; o_queue_start assumes every down item after every gate/up item)
        self.queue_dn_lag = self.dn_lag if self.pg_n and not self.o_items else 0
        # route record layout (int32 offsets)
        ns, npair = self.n_slots, self.n_pairs
        off = 2                              # [0] n_active, [1] n_items
        self.r_slot_expert = off; off += ns
        self.r_slot_start = off; off += ns
        self.r_slot_cnt = off; off += ns
        self.r_pair_row = off; off += npair
        self.r_pair_rank = off; off += npair
        self.r_pair_w = off; off += npair       # float bits
        self.r_topk_ids = off; off += npair     # [Bm, topk] in top-k order (trace)
        self.r_stride = (off + 63) // 64 * 64
        # counters: per layer a block of CPL counters, then XF and LM
        self.c_x, self.c_qkv = 0, 1
        self.c_att = 1 + self.nkv
        self.c_comb = self.c_att + Bm * self.nkv
        self.c_o, self.c_rl, self.c_route, self.c_mgu, self.c_mlp = (self.c_comb + i for i in range(1, 6))
        self.c_gu = self.c_comb + 6
        self.cpl = self.c_gu + self.n_slots
        self.c_xf = self.L * self.cpl
        self.c_lm = self.c_xf + 1
        self.n_counters = self.c_lm + 1
        self.sync_ints = O.CTRL_INTS + self.n_counters + max(1, self.Lm)

    def _page_layout(self, o_in_queue: bool) -> None:
        """The paged MoE worker's shared memory (pg_n = 0: not used by this plan), for up to pg_rows input rows per
        item (tile_batch, or slot_pairs): pg_slots items in flight (the build's MK_PAGE_SLOTS), each with an input
        buffer (a down item's activation rows, an O item's attention rows; a gate/up item's x rows where pg_x_item,
        else it reads the layer's x rows, loaded once per worker into a buffer of their own) and its fp32 outputs
        (pg_rows x pg_out_rows), after as many pages as fit the usable shared memory (at most PAGE_MAX, at most
        moe_pages_max where that is set), then its barriers and bookkeeping (PAGE_STATE_BYTES). pg_x_item where
        moe_pages_x_item and the per-item rows leave more pages than the shared x buffer."""
        self.pg_n = self.pg_in_off = self.pg_in_bytes = self.pg_out_off = self.pg_out_rows = self.pg_state_off = 0
        self.pg_rows = self.pg_x_off = self.pg_x_item = self.pg_slots = self.pg_page_bytes = self.pg_page_warps = 0
        if not (self.moe_pages and self.moe_pages_from <= self.tb <= self.moe_pages and self.Lm and not self.wbuf
                and not self.moe_wbuf):
            return
        slots = page_slots()                 # (the build's item slots: MK_PAGE_SLOTS)
        pb = page_bytes()                    # (the build's page size: MK_PAGE_BYTES)
        wpp = page_warps()                   # (the build's computing warps per page: MK_PG_PAGE_WARPS)
        R = self.tb if o_in_queue or not self.slot_pairs else min(self.tb, self.slot_pairs)   # rows per item
        out_rows = max(2 * self.gu_rows, self.dn_rows, self.o_rows if o_in_queue else 0)

        def layout(x_item: int) -> tuple[int, int, int]:
            """(pages, input buffer bytes, shared x buffer bytes)"""
            k_in = max(self.I, self.Q if o_in_queue else 0, self.H if x_item else 0)
            in_bytes = (R * k_in * 2 + 15) // 16 * 16
            x_bytes = 0 if x_item else (self.tb * self.H * 2 + 15) // 16 * 16   # (every row of the launch)
            fixed = slots * (in_bytes + R * out_rows * 4) + x_bytes + 32 + O.PAGE_STATE_BYTES
            # wpp computing warps per page (warps 0 .. NUM_WARPS - 3: each owns a ring page's rows, mk_moe_pages.cuh)
            n = min(O.PAGE_MAX, (O.NUM_WARPS - 2) // wpp, self.moe_pages_max or O.PAGE_MAX,
                    (O.SMEM_LIMIT - O.SMEM_RESERVE - fixed) // pb)
            return n, in_bytes, x_bytes
        n, in_bytes, x_bytes = layout(0)
        x_item = 0
        if self.moe_pages_x_item == 2 or (self.moe_pages_x_item and layout(1)[0] > n):
            x_item = 1
            n, in_bytes, x_bytes = layout(1)
        if n < 4 or max(self.H, self.I, self.Q) * 2 > pb:
            return                           # (a page holds at least one row of every item kind)
        rows_per_page = lambda K: min(pb // (2 * K), O.PAGE_ROWS_MAX)   # noqa: E731
        most = max(2 * math.ceil(self.gu_rows / rows_per_page(self.H)), math.ceil(self.dn_rows / rows_per_page(self.I)),
                   math.ceil(self.o_rows / rows_per_page(self.Q)) if o_in_queue else 0)
        if most * wpp > O.PAGE_ITEM_PAGES_MAX:   # (an item slot's `outs` barrier counts 32 arrivals per page warp)
            return
        self.pg_n, self.pg_rows, self.pg_x_item, self.pg_slots, self.pg_page_bytes = n, R, x_item, slots, pb
        self.pg_page_warps = wpp
        self.pg_in_off = n * pb
        self.pg_in_bytes = in_bytes
        self.pg_out_off = self.pg_in_off + slots * in_bytes
        self.pg_out_rows = out_rows
        self.pg_x_off = (self.pg_out_off + slots * R * out_rows * 4 + 15) // 16 * 16
        self.pg_state_off = (self.pg_x_off + x_bytes + 15) // 16 * 16

    def pages_smem_bytes(self) -> int:
        """End of the paged worker's layout (0 without it)."""
        return self.pg_state_off + O.PAGE_STATE_BYTES if self.pg_n else 0

    def _two_buffers(self, k_x: int, min_tile: int, extra: int) -> int:
        """Bytes of each of two weight buffers followed by tile_batch input rows of k_x elements (prefetch_wbuf), or 0
        unless a buffer holds a tile of min_tile bytes and the small tasks' layouts stay clear of buffer 1 (they
        prefetch into it while they run)."""
        b = prefetch_wbuf(k_x, self.tb, extra)
        ok = b >= min_tile and small_task_smem_bytes(self.E, self.H) <= O.GEMV_SCRATCH_BYTES + b
        return b if ok else 0

    # ---- smem -----------------------------------------------------------------------------------------------------
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the kernel (its task kinds' layouts are in csrc/mk_*.cuh, described by
        `smem_bytes` above from this plan's tiles)."""
        fused = fused_norm_smem_bytes(self.H) if self.fused_norm else 0   # the fused tiles' residual row
        total = smem_bytes(self.gemv_tiles, self.tb, self.d, self.g, self.E, self.H, self.wbuf, self.k_max)
        if self.lm_wbuf:                     # the streaming LM head's two buffers and its inputs
            total = max(total, O.GEMV_SCRATCH_BYTES + 2 * self.lm_wbuf + self.tb * (self.H + O.ROW_PAD) * 2)
        if self.moe_wbuf and not self.wbuf:  # the expert items' ring and their inputs
            total = max(total, O.GEMV_SCRATCH_BYTES + 2 * self.moe_wbuf
                        + self.tb * (max(self.H, self.I) + O.ROW_PAD) * 2)
        if self.worker_topk and self.Lm:     # a worker's routing scratch and its copy of the route record
            total = max(total, (route_scratch_bytes(self.E) + 15) // 16 * 16 + self.r_stride * 4)
        return max(total + fused, self.pages_smem_bytes())

    def check_supported(self) -> None:
        """Raise ValueError naming the first dimension the kernel does not handle."""
        cfg = self.cfg
        for name, v in (("hidden_size", self.H), ("q_size", self.Q), ("head_dim", self.d),
                        ("moe_intermediate_size", self.I), ("mlp width", self.I_mlp)):
            if v % 8:
                raise ValueError(f"{name}={v} is not a multiple of 8")
        if self.d > O.ATTN_MAX_HEAD_DIM or self.d % 16:
            raise ValueError(f"head_dim={self.d} unsupported (a multiple of 16, <= {O.ATTN_MAX_HEAD_DIM})")
        if self.g > O.ATTN_MAX_GROUP or self.g * self.d > O.NUM_THREADS * O.ATTN_OUT_PER_THREAD:
            raise ValueError(f"{self.g} query heads per kv head of dim {self.d} unsupported")
        if self.E > O.MAX_EXPERTS or self.topk > O.MAX_TOPK or (self.Lm and self.topk > self.E):
            raise ValueError(f"{self.E} experts / top-{self.topk} unsupported")
        if self.split_align <= 0 or self.split_align % 64:
            raise ValueError(f"split_align={self.split_align}: want a positive multiple of 64 keys")
        if not 2 <= self.attn_stages <= O.ATTN_MAX_STAGES:
            raise ValueError(f"attn_stages={self.attn_stages} outside 2..{O.ATTN_MAX_STAGES}")
        if self.n_groups > 2:
            raise ValueError("more than two KV groups")
        if self.smem_bytes() > O.SMEM_LIMIT:
            raise ValueError(f"needs {self.smem_bytes()} bytes of shared memory (> {O.SMEM_LIMIT}); "
                             f"lower max_batch")
        if self.qkv_rows < 2:
            raise ValueError("QKV tile too small for RoPE pairs")
        if cfg.vocab_size >= 1 << 24:
            raise ValueError("vocab too large for the fp32 argmax index")

    # ---- scratch --------------------------------------------------------------------------------------------------
    def scratch_spec(self, act_dtype: torch.dtype, n_lm_tiles: int | None = None
                     ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Named scratch buffers (shape, dtype). Every buffer is written once per step (no reuse in a step).
        n_lm_tiles: LM-head maxima to hold (default this plan's; a backend with several plans passes their max)."""
        L, Bm, H, Q = self.L, self.max_batch, self.H, self.Q
        Lm = max(1, self.Lm)
        f32, i32 = torch.float32, torch.int32
        return {
            "h": ((L + 1, Bm, H), act_dtype),
            "x": ((L + 1, Bm, H), act_dtype),
            "q": ((L, Bm, Q), act_dtype),
            "attn": ((L, Bm, Q), act_dtype),
            "ao": ((L, Bm, H), act_dtype),
            "rlog": ((Lm, Bm, self.E), f32),
            "route": ((Lm, self.r_stride), i32),
            "eact": ((Lm, self.n_pairs, self.I), act_dtype),
            "y": ((Lm, Bm, self.topk, H), act_dtype),
            "mact": ((L, Bm, self.I_mlp), act_dtype),
            "mout": ((L, Bm, H), act_dtype),
            "lm_best": ((n_lm_tiles or self.n_lm_tiles, Bm, 2), f32),
            "tokens": ((Bm,), i32),
        }

    # ---- per step -------------------------------------------------------------------------------------------------
    def split_size(self, max_range: int, B: int = 1, row_ranges: Sequence[int] | None = None) -> int:
        """Keys per attention split for a step whose longest range is max_range over B rows (row_ranges: each
        row's longest range, for split_waves; default B rows of max_range)."""
        if self.split_tokens is not None:
            return self.split_tokens
        s = O.DEFAULT_SPLIT_TOKENS
        if self.wide_split_batch and B >= self.wide_split_batch:
            s *= 2
        wider = 4 * O.DEFAULT_SPLIT_TOKENS
        if self.wider_split_batch and B >= self.wider_split_batch and split_fits_table(wider, self.layout.block_size):
            s = wider
        need = math.ceil(max_range / O.MAX_SPLITS_PER_HEAD)
        if need > s:
            a = max(64, self.split_align)
            s = (need + a - 1) // a * a
            if self.split_waves:
                rows = row_ranges if row_ranges is not None else [max_range] * B
                assert max(rows) <= max_range, "row_ranges past max_range would break the split count cap"
                s = self._fewest_key_waves(s, a, rows)
        elif B == 1 and self.short_splits and max_range < s * self.short_splits:
            s = max(MIN_SHORT_SPLIT, (math.ceil(max_range / self.short_splits) + 63) // 64 * 64)
        return s

    def _fewest_key_waves(self, s: int, a: int, row_ranges: Sequence[int]) -> int:
        """split_waves: of the splits s, s + a, ... up to WAVE_SPLIT_MAX keys (each within the count cap, as s is),
        the one whose full layer (n_kv splits per row range) takes the fewest keys of waves over n_workers blocks: a
        last wave that is nearly empty costs a whole split's time (b1 128K: 640-key splits are 820 a layer, 6.2
        waves of 132; 1024-key ones 512, 3.9 waves)."""
        best, best_cost = s, None
        for c in range(s, max(s, WAVE_SPLIT_MAX) + 1, a):
            if not split_fits_table(c, self.layout.block_size):
                break
            n = self.nkv * sum(-(-int(r) // c) for r in row_ranges)
            cost = -(-n // max(1, self.n_workers)) * c
            if best_cost is None or cost < best_cost:
                best, best_cost = c, cost
        return best

    def layer_info(self) -> np.ndarray:
        info = np.zeros((self.L, O.LAYER_INFO_INTS), dtype=np.int32)
        for l in range(self.L):
            g, j = self.layout.locate(l)
            w = self.cfg.window_for(l)
            info[l] = [int(self.cfg.uses_rope(l)), g, j, w if w is not None else 0,
                       self.moe_idx.get(l, -1), self.mlp_kind[l], self.mlp_width[l], 0]
        return info


def tiling_plans(cfg: ModelConfig, layout: KVLayout, max_batch: int, per_batch: bool, **knobs) -> list[ModelPlan]:
    """The plans a backend launches, by increasing tile_batch; the last is sized for max_batch rows (and sizes the
    scratch, but for the LM-head maxima and MoE items: a plan of fewer rows may have smaller, double-buffered
    tiles, so the backend sizes those from the max over its plans).
    per_batch: one plan per distinct tiling over 1..max_batch rows (fewer rows leave room for larger tiles); with
    prefetching (or the expert ring) the tiles shrink with every row, so only powers of two are candidates (as the
    graph's buckets)."""
    full = ModelPlan(cfg, layout, max_batch, **knobs)
    if not per_batch:
        return [full]
    # the streaming LM head's tiles shrink with every row of input; they do not split plans (the plan of the largest
    # tile_batch with the same other tiles serves the smaller launches, its LM tiles sized for its rows)
    # (a paged plan's expert items are not GEMV tiles: their rows are part of its key, so the one-row plan's own
    # item size, moe_pages_tile_kb_1row, is not merged into a larger plan's; nor are plans whose input warp loads
    # the layer's x rows once into plans loading each item's own, pg_x_item: that is a different worker; nor a plan
    # whose static O tiles have their own place among the workers, o_workers_after_2row)
    key = lambda p: (tuple(t for t in p.gemv_tiles if t is not p.lm_tile), p.wbuf, p.moe_wbuf > 0,   # noqa: E731
                     p.lm_wbuf > 0, p.o_items > 0, p.pg_n > 0,
                     p.o_workers_ahead if p.Lm and not p.o_items else -1,
                     (p.gu_rows, p.dn_rows, p.pg_x_item) if p.pg_n else ())
    by_tiles: dict[tuple, ModelPlan] = {}
    shrinking = knobs.get("prefetch", ModelPlan.prefetch) or knobs.get("moe_ring", ModelPlan.moe_ring)
    cands = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch] if shrinking else range(1, max_batch)
    for tb in cands:
        p = ModelPlan(cfg, layout, max_batch, tile_batch=tb, **knobs)
        by_tiles[key(p)] = p                               # the largest tile_batch with this tiling wins
    by_tiles.pop(key(full), None)
    return sorted(by_tiles.values(), key=lambda p: p.tb) + [full]


def plan_for_rows(plans: list[ModelPlan], B: int) -> ModelPlan:
    """The plan a launch of B rows runs: the first (largest tiles) whose tile_batch covers B, skipping a paged plan
    (moe_pages) for fewer rows than it is meant for (its tiles may equal a plain plan's that serves them: the paged
    worker runs any B <= tile_batch correctly, but was measured slower below moe_pages_from rows). The last plan
    (tiling_plans' full one) covers every B."""
    return next(p for p in plans if p.tb >= B and (not p.pg_n or B >= p.moe_pages_from or p is plans[-1]))
