// The paged MoE worker's (mk_moe_pages.cuh) role warps and build switches: what each switch does and what it
// measured, beside its default. mk_pg_sync.cuh and mk_pg_items.cuh read them; the worker itself in mk_moe_pages.cuh.
#pragma once
#include "mk_common.cuh"

#define PG_INPUT_WARP (NW - 2)          // warp NW - 2 loads inputs, warp NW - 1 weights; warps 0 .. pg_n *
                                        // MK_PG_PAGE_WARPS - 1 compute
#define PG_LOADER_WARP (NW - 1)
// MK_PG_PAGE_STATS=1 (with MK_PROFILE, a diagnostic build): a paged item's four marks hold sums over its pages, in ns,
// instead of stamps: m0 its warps' waits for the page to land (starved), m1 their waits for the item's inputs (low
// 32 bits) and the count of pages a warp was already waiting for when they landed (high 32), m2 their math, m3 the
// loader's waits for the page's ring slot to free (low 32) and, over the counted pages, issue to landing (the
// page's flight, high 32); the high halves of m0 and m2: the loader's decode of the item (from its item slot's
// wait to the publish: moe_item's table reads; under MK_PG_DECODE_EARLY from the decode's start, so the slot's wait
// too) and its time inside the pages' issue (after each ring slot's wait,
// to the bulk copy issued: the proxy fence, the expect_tx arrive, the copy instruction, and this build's own timer
// reads and shared atomics). (Until session 34 the two halves held the loader's waits for the item slot and for the
// claim's result: medians 0.06-0.19 and 0.03 us per item at b1 on the H200, speed_20261206s34 call 1.) Which of
// them the item's time goes to says whether the ring is short of bytes in flight (m0), its warps are the bound (m3
// with small m0), the copies are slow to land (the flight), or the loader is slow to issue (decode and issue).
#ifndef MK_PG_PAGE_STATS
#define MK_PG_PAGE_STATS 0
#endif
#define PG_STATS (MK_PROFILE && MK_PG_PAGE_STATS)
// MK_PG_SEG_TC: the one-input-row page product on tensor cores with K cut into segments (mk_page_math.cuh
// pg_rows_seg; 1), or the CUDA-core loop (pg_rows; 0). benchmarks/page_math.cu, alone on an SM: a gate/up page (4
// rows of 2048) 0.76 vs 2.08 us per warp, a down page (10 of 768) 0.97 vs 2.71, an O page (2 of 4096) 0.82 vs 2.04;
// with 12 warps 139 / 80 / 129 GB/s per SM against 80 / 60 / 81. In the step slower (b1 +3.4%, SPEED_NOTES'
// twenty-first session): the pages then wait longer for their copies.
#ifndef MK_PG_SEG_TC
#define MK_PG_SEG_TC 0
#endif
// MK_PG_CLAIM_LEAD: the loader claims its next item this many pages before the current item's last page is issued
// (1: just before it; 0: at the item's middle page). The claim is an atomic round trip (1.4-3.2 us under load,
// mem_latency.cu) that the loader waits for after the item's last page; with a larger lead it lands under more of
// the item's page waits, but a worker holds its next item longer (the layer's tail). 8K, ms at 1 / 4 / 8 (961268a,
// each build in its own process): b1 3.111 / 3.100 / 3.123, b8 10.99 / 10.92 / 10.91, b16 17.69 / 17.59 / 17.56;
// at 1 / half an item (0) / 4 (8512fc1): b1 3.113 / 3.110 / 3.094, b8 11.04 / 11.01 / 10.97, b16 17.71 / 17.65 /
// 17.62. 4 pages (a b1 gate/up item is 8, a b8 or b16 one 16). The claim is made between two page loops, the pages
// before and after it: a SASS audit (session 23) found that with the atomic inside the one loop, the branch around it
// waited on the atomic's scoreboard at every page (ptxas guards the next lap's write of its register), so the loader
// stalled for the round trip one page after the claim (measured even either way, session 24; the loop form was
// MK_PG_CLAIM_SPLIT=0, and two claims in flight MK_PG_CLAIM_AHEAD=2, both removed in session 26: the SASS put both
// claims' atomics on one scoreboard, so it hid no more than the lead).
#ifndef MK_PG_CLAIM_LEAD
#define MK_PG_CLAIM_LEAD 4
#endif
// MK_PG_PROXY_FENCE: a proxy fence before each page's copy (1), or one before the loader's first copy (0: from the
// ring's second lap on, the computing warp's reads are ordered before the copy's writes by the `empty` mbarrier
// alone, as CUTLASS's TMA pipelines do: the consumer's release a plain arrive on the empty barrier, the producer's
// acquire a wait on it, then the copy; the first lap, which waits on nothing, follows the one fence). 0 since
// session 34: on the H200 (speed_20261206s34 call 3, each build in its own process, twice; measured with no fence at
// all, the one-time fence added after review) b1 8K 2.845 / 2.840 against 2.869 / 2.868 ms, 1K 2.699 / 2.698
// against 2.733 / 2.735, b8 9.278 / 9.278 against 9.381 / 9.379 (-0.9 to -1.3%); on the H100 (session 31 call 20)
// within 0.1%.
#ifndef MK_PG_PROXY_FENCE
#define MK_PG_PROXY_FENCE 0
#endif
// MK_PG_DECODE_EARLY: the loader decodes its next item (moe_item's table reads, its page count) before it waits for
// the item's slot to free (1), or after (0). Where items are at most pg_n / MK_PAGE_SLOTS pages (the H100 plan's b1
// gate/up items: 4 pages, 3 slots, a 12-page ring), every item slot is busy while the ring is full, and a slot
// frees only after its item's epilogue: the loader's next item then waits for the epilogue MK_PAGE_SLOTS items back
// and for its own decode (0.7 us in the page stats) before its first page can issue. 1 since session 36: on the
// H100 (speed_20261207s36 calls 1 and 2, each build in its own process, twice per call) b1 8K 3.315 / 3.317 and
// 3.306 / 3.309 ms against 3.327 / 3.319 and 3.322 / 3.318 (-0.2 to -0.4%), 1K -0.8 to -1.0%, b8 +0.1%;
// `tests/kernel -m gpu` passes under it (37). Not yet measured on the H200. Its page stats' decode field spans the
// decode and the slot's wait (from the decode's start to the publish).
#ifndef MK_PG_DECODE_EARLY
#define MK_PG_DECODE_EARLY 1
#endif
// MK_PG_MULTI_ISSUE: an item's pages issued by the loader's lanes at once, lane i page base + i in rounds of at most
// pg_n pages (distinct ring slots), each lane polling its own slot (test_wait: a lane issues as soon as its slot is
// free, not when the round's last is), the claim MK_PG_CLAIM_LEAD pages before the item's end as in the page loop (the
// round split there) (1); or one page after another, each waiting for its slot (0). benchmarks/pg_stream.cu (H100,
// speed_20261207s37) puts the one-lane page loop's cap at ~30 GB/s per SM below HBM's limit (~0.4 us a page with
// nothing else to do), the multi-lane rounds' at ~50. With holes possible in a failed round (an abort), each ring page
// records the sequence number of its last issue (`seq`) and the closing drain waits for that one. Its page stats'
// ring-slot waits sum the lanes' parallel waits. In the step on the H100: speed_20261207s36 (the claim then at the
// item's start) b1 8K -0.3% / even, 1K +0.5% / +0.8%, b8 -0.2%; speed_20261207s37 (this form, MK_PG_POLL_CHECK=1)
// b1 8K +2.0%, 1K +3 to +6%, b8 even; speed_20261207s38 (two calls, each build in its own process, twice) with
// MK_PG_POLL_CHECK=32: b1 8K +1.3 / +1.3%, 1K +2.5 / +2.7%, b8 even, b16 -0.1 to -0.3%. Its page-stats build is
// faster than the default's (3.46 against 3.53 ms profiled) because the stats' timers and atomics sit in the lane-0
// loop's serial path: compare normal builds. Not measured on the H200, where the loader paces the one-row workers.
#ifndef MK_PG_MULTI_ISSUE
#define MK_PG_MULTI_ISSUE 0
#endif
#if MK_PG_MULTI_ISSUE
static_assert(MK_PAGE_MAX <= 32, "MK_PG_MULTI_ISSUE: a loader lane per ring page of a round");
#endif
// MK_PG_ANY_SLOT: each page into whichever ring page is free first (1), or page s into ring page s % pg_n once its
// previous lap is free (0). The loader's lane i keeps ring page i's lap count (its copies and end markers so far) and
// tests its `empty` phase; each page goes, in sequence order, into the lowest ring page free when it is issued, by
// that page's lane. The computing warps are unchanged: warp w still takes ring page w's laps one after another (its
// `full` and `empty` still alternate between one producer and one consumer), only which of the worker's pages a lap
// holds is no longer s % pg_n. Why: tma_issue.cu's ring (speed_20261207s41 call 5, H200, 32 SMs, 16 KB x 12) streams
// scattered 8-page items at 33.5 GB/s per SM refilled in sequence order, 41.7 in landing order (a slow page no longer
// holds the pages behind it). Still no deadlock: pages are issued in sequence order, so an item's pages are all out
// before any later item's, and a ring page a page waits for is held only by earlier-or-equal items' pages (the
// argument at the top, whose "ring pages issued in sequence order" becomes "pages issued in sequence order"). Each ring
// page records its lap count (`seq`), which the closing drain waits on. Two things change at once against the
// default: the landing order, and the loader's wait, a test_wait sweep over its lanes that never suspends (the
// default's try_wait can) and so takes issue slots from the computing warps while no page is free, which MULTI_ISSUE's
// measurements suspected of slowing the math. A helper's SASS audit of the 32 KB two-warp builds (session 42, CPU):
// with the page free at the first test, 73 instructions from one bulk copy to the next against 111 in sequence order
// (no `s % npg` division, one mbarrier test instead of a try-wait, a shuffle and every lane's wait), 3 serial
// scoreboard waits against 7. On an H100 (speed_20261207s43 call 1, each build in its own process, twice; the
// tma_issue ring there: scattered items 32.4 GB/s per SM in sequence order, 40.8 in landing order) b1 8K 3.289 / 3.294
// ms against 3.280 / 3.285 (+0.3%), 1K +0.7%, b8 -0.6%, b16 -0.5%: the microbenchmark's gain does not reach the step.
// 0; not measured on the H200.
#ifndef MK_PG_ANY_SLOT
#define MK_PG_ANY_SLOT 0
#endif
#if MK_PG_ANY_SLOT
static_assert(MK_PAGE_MAX <= 32, "MK_PG_ANY_SLOT: a loader lane per ring page");
static_assert(!MK_PG_MULTI_ISSUE, "MK_PG_ANY_SLOT and MK_PG_MULTI_ISSUE: one or the other");
#endif
// MK_PAGE_SLOTS (a build switch; its default, opcodes.PAGE_SLOTS = 3, in the generated header): items in flight,
// each slot with its description, barriers, input buffer and outputs; the plan lays out the build's count
// (build.page_slots) and the library reports it (mk_page_slots, checked against the plans). With items of pg_n / 3
// pages or fewer (the H100's b1 gate/up items: 4 of a 12-page ring) three slots hold no more than the ring, and each
// frees only after its item's epilogue. 4 slots cost the one-row North plan a ring page (an 8 KB input buffer
// each). On the H100 (speed_20261207s36) even alone; with MK_PG_DECODE_EARLY b1 8K -0.3 to -0.4% and 1K -0.6 to
// -0.9% against that switch alone, b8 +0.1%. Not measured on the H200, whose one-row ring it shortens.
// MK_PAGE_BYTES (a build switch; its default, opcodes.PAGE_BYTES = 16384, in the generated header; 32768 allowed):
// a ring page and each of the loader's bulk copies; the plan lays out the ring in pages of the build's size
// (build.page_bytes) and the library reports it (mk_page_bytes, checked against the plans). pg_stream.cu (H100,
// speed_20261207s38 call 3) puts the lane-0 loop's per-SM cap on a cost per copy issued: loads only 19.4 / 34.7 /
// 55.3 GB/s per SM at 32 SMs with 8 / 16 / 32 KB copies, with the decode and the release 28.7 / 41.4 at 16 / 32 KB.
// 32 KB pages halve the copies but also the computing warps (6 pages, each of twice the rows). In the step on the H100
// (call 4, each build in its own process, twice): b1 8K 3.430 / 3.420 against 3.290 / 3.277 ms (+4.3%), 1K +5.0%,
// b8 +1.0%, b16 +0.4%; GPU tests pass under it (33). Not measured on the H200, whose one-row workers the loader
// paces.
// MK_PG_PAGE_WARPS (a build switch, 1 or 2; its default, opcodes.PAGE_WARPS, in the generated header; the plan reads
// it, build.page_warps): computing warps per ring page. 2:
// warps w and w + pg_n share ring page w, each multiplying its half of the page's n rows (the first (n + 1) / 2, the
// rest: none for a one-row page, whose second warp still arrives and counts), both waiting on the page's `full`
// phase, both arriving on its `empty` (count 2) and on the item's `outs`, each counted in the item's `done`; so 32 KB
// pages (MK_PAGE_BYTES=32768: half the copies) keep 12 computing warps. Its page stats sum the math over both warps,
// the waits and the flight over the page's first. The protocol model (test_pages_protocol.py) runs two warps per
// page; the row split is checked only by the GPU tests (whose pages may never hold one row). On the H100 with
// MK_PAGE_BYTES=32768 (speed_20261207s38 call 5, each build in its own process, twice): b1 8K 3.283 / 3.319 against
// 3.289 / 3.285 ms, 1K 3.137 / 3.139 against 3.106 / 3.103 (+1.0%), b8 10.992 / 10.994 against 11.065 / 11.061
// (-0.6%), b16 17.274 / 17.280 against 17.362 / 17.364 (-0.5%); 32 KB pages with one warp each were +4% at b1 in the
// same call. Under racecheck its runs stopped in a 10-30 s host watchdog in sessions 38-40; with a 120 s watchdog
// (speed_20261207s41 calls 1-2, H100) all 8 runs of the 32 KB builds (two warps at one and two rows, one warp at two
// rows) pass with 0 hazards, taking 6 to 44 s (passing 16 KB runs took 7-16): the sanitizer crawls, nothing hangs
// (the default 16 KB build with a 6-page ring also passed 4 of 4). On the H200 (call 5, each build in its own process,
// twice): b1 8K 2.840 / 2.788 against 2.882 / 2.874 ms, 1K -1.5%, b8 -1.4 to -1.8%, b16 -2.1 to -2.3%, with b2 -2.1%,
// b4 -1.2%, 32K -2.4% but 128K +0.4 / +1.0% (call 8); test_gpu.py 33, memcheck and racecheck (2, 16 rows) clean there
// (calls 6, 7). So the H200's builds use it (tuning.CARD_SWITCHES); the defaults stay 16 KB and one warp.
static_assert(MK_PG_PAGE_WARPS == 1 || MK_PG_PAGE_WARPS == 2, "MK_PG_PAGE_WARPS: 1 or 2");
// MK_PG_TLB_WARM (a build switch, 0): at the worker's start, before its first copy, the loader's lanes prefetch one
// line of every 2 MB region of the layer's routed experts' gate/up and down weights into L2 (1: by the copy engine,
// cp.async.bulk.prefetch; 2: by the load path, prefetch.global.L2), so each region's address translation is done
// before its items' copies are issued. Why: benchmarks/tma_issue.cu's ring (speed_20261207s41 call 5, H200, 32 SMs)
// streams ~70 GB/s per SM from contiguous pages but ~34 from 8-page items at scattered places (a new 2 MB region per
// item, as the routed experts lie), ~2 us more per item whatever the page size: a translation miss would fit, not
// shown. Not measured: first tma_issue's ring with the same warm-up (its tma-warm / lsu-warm variants), then this.
// 3: instead, the block that routed the layer (TOPK, or router_topk's last router tile) warms the same regions by the
// copy engine right after its signal (mk_routing.cuh topk_warm_regions), ~3 us before the workers' first copies
// (b1 trace, session 34: the top-k's end at 13.2 us into the layer, the first gate/up claim at 16.6): the first
// items' translations too, not only the later ones', if the walks it starts warm what the workers' SMs look up (the
// per-SM TLBs it does not). Nothing in worker_topk plans (no block routes the layer for the workers). The TOPK
// task's end stamp comes before it, so a trace does not show its time. Measured on an H100 (speed_20261207s43, each
// build in its own process): tma_issue's ring gains nothing from any warm-up (32 SMs, 16 KB x 12, scattered in-order
// 32.4 GB/s per SM, 30.1-30.4 with one or two items warmed ahead by either path), so translation is not the
// scattered item's cost. Mode 1 loses (b1 8K +2.3%, 1K +3.5%, b8 +4.1%, b16 +5.7%: the prefetches at the worker's
// start delay its first copies); mode 3 wins a little (b1 8K -0.7%, 1K -0.9%, 32K -0.8%, 128K -0.9%, b2-b8 -0.1 to
// -0.2%, b16 even; tests, memcheck, racecheck pass), for a reason not shown (the first lines of each region in L2
// ahead of the workers, or DRAM rows opened, not translations): the H100's row of tuning.CARD_SWITCHES. Not measured
// on the H200.
#ifndef MK_PG_TLB_WARM
#define MK_PG_TLB_WARM 0
#endif
#if (MK_PG_TLB_WARM == 1 || MK_PG_TLB_WARM == 2) && !MK_MOE_LOCAL
#error "MK_PG_TLB_WARM=1/2 reads the layer's routed experts from shared memory (MK_MOE_LOCAL=1)"
#endif
static_assert(MK_PG_TLB_WARM >= 0 && MK_PG_TLB_WARM <= 3, "MK_PG_TLB_WARM: 0..3");
// MK_PG_RING_COUNTERS (a build switch, 0): the in-order loader (neither MULTI_ISSUE nor ANY_SLOT) keeps the next
// page's ring slot and lap in two counters, stepped per page (1), instead of computing s % pg_n and s / pg_n at every
// page and end marker (0). pg_n is a runtime parameter, so each division is a reciprocal sequence (I2F, MUFU.RCP,
// IMAD.HI: ~40 instructions a page in the 32 KB two-warp build's SASS, session 42's audit) on the loader's serial
// path, which paces the H200's one-row workers (session 34's page stats: pages issued late, ring mostly empty). Same
// pages, slots and phases in the same order. On an H100 (speed_20261207s43 call 1, each build in its own process,
// twice) b1 8K 3.305 / 3.304 ms against 3.280 / 3.285 (+0.7%), 1K +1.3%, b8 -0.3%, b16 -0.1%: the one-row step slower
// for fewer instructions, not understood (the H100's workers are near HBM's rate, not loader-paced). 0; not measured
// on the H200, where the loader paces them.
#ifndef MK_PG_RING_COUNTERS
#define MK_PG_RING_COUNTERS 0
#endif
#if MK_PG_RING_COUNTERS && (MK_PG_MULTI_ISSUE || MK_PG_ANY_SLOT)
#error "MK_PG_RING_COUNTERS steps the in-order loader's ring slot: not with MK_PG_MULTI_ISSUE or MK_PG_ANY_SLOT"
#endif

#define PG_END (-1)                     // an item description's kind: no more items (the input warp stops)
