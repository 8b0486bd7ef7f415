// The paged MoE worker (plans with moe_pages, up to pg_rows input rows per item): the same items in the same claim
// order as the plain worker (mk_moe.cuh), but the SM never stops loading at an item boundary. Three roles, no
// block-wide barrier between pages or items, and every hand-off between warps through an mbarrier (arrive: release,
// wait: acquire), none through a polled flag, so compute-sanitizer's racecheck sees each one ordered:
// - the loader (warp NW - 1) claims the next item as it issues this item's fourth page from the end (MK_PG_CLAIM_LEAD:
//   the claim's round trip under those pages' waits, and no item held while a whole item's pages wait for the ring;
//   pg_claim_late: after the last page, once the input warp has this item's inputs), publishes each item's
//   description in one of PAGE_SLOTS item slots (`desc`; an end item after the last), and streams its weight rows
//   into a ring of pg_n pages (PAGE_BYTES each, whole rows, one bulk copy per page) as pages free: weights never
//   wait on a counter;
// - the input warp (NW - 2) first loads the layer's x rows (every gate/up item's inputs: the routing the worker
//   waited for was laid out after them; pg_x_item: none, each gate/up item's own rows go in its slot instead), then
//   walks the items in order: waits for the item's dependency (a down
//   item: its expert's gate/up items; an O item: the attention combines), loads its input rows into the slot and
//   arrives on the slot's `inp`, so inputs load while earlier pages compute instead of after the item's first page
//   landed;
// - the computing warps (0 .. pg_n - 1; one ring page each): warp w takes pages w, w + pg_n, w + 2 pg_n, ... of the
//   worker's page sequence, i.e. always ring page w, so its `full` and `empty` barriers alternate between one
//   producer and one consumer and their parity never skips a phase (with more warps than pages, the earlier
//   protocol needed a polled sequence number per page to tell phase u from u - 2; MK_PG_PAGE_WARPS=2 gives each page
//   two consumers, warps w and w + pg_n, each with half its rows and both freeing it; MK_PG_ANY_SLOT: ring page w's
//   laps hold whichever pages the loader put there, still one producer and its consumers per lap). It waits for the
//   page and its item's `inp`, multiplies the page's rows by the inputs, arrives on the item's `outs` and frees the
//   page; the warp that counts an item's last page (an atomic count elects it) waits on `outs` (every page's
//   outputs), writes the item's epilogue and frees its slot (`free_`).
// Parity: an item slot's barriers complete once per item in it (items q, q + SLOTS, ...). A wait for item j's phase
// can meet the slot one phase behind (not yet arrived), never two: the loader reuses a slot only after the previous
// item's `free_`, which needs that item's inputs, every page and its epilogue.
//
// Why no deadlock: each worker claims items in increasing queue order, and every item's dependencies come earlier in
// the queue (a down item's gate/up items: queue_kind keeps them ahead under any dn_lag; O items wait only on static
// tasks listed before the workers). Take the earliest unfinished item in the queue: every earlier item is finished,
// so its dependency is met; its worker claimed nothing unfinished before it, so that worker's input warp, ring
// pages (issued in sequence order, this item's before any later item's) and item slots all serve it next: it
// finishes. The loader waits only for pages and item slots freed by the computing warps, the computing warps for
// pages and for earlier-or-equal items' inputs, the input warp, in item order, for counters.
// (tests/kernel/test_pages_protocol.py runs a model of this protocol under random schedules.)
#pragma once
#include "mk_common.cuh"
#include "mk_loader.cuh"
#include "mk_gemv_core.cuh"
#include "mk_page_math.cuh"

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

// The worker's barriers and bookkeeping: in the plan's dynamic shared memory (at pg_state_off, PAGE_STATE_BYTES of
// opcodes.py), so plans without the paged worker do not pay for them in every block's static shared memory. Set up at
// each call, invalidated before the call returns (other task kinds reuse the memory between layers).
struct PgState {
#if MK_STALL_PRINT
    int canary[4];                             // (MK_STALL_PRINT) written at set-up, printed with a stall: whether the
                                               // barriers' memory was overwritten, or only their state is wrong
#endif
    unsigned long long full[MK_PAGE_MAX];      // a page landed (tx) or an end marker
    unsigned long long empty[MK_PAGE_MAX];     // its warp is done reading it (an end marker's too)
    unsigned long long desc[MK_PAGE_SLOTS];    // an item's description is written (the loader)
    unsigned long long inp[MK_PAGE_SLOTS];     // its input rows are loaded (the input warp, every lane)
    unsigned long long outs[MK_PAGE_SLOTS];    // its pages are computed (count PAGE_OUT_ARRIVALS: the 32 lanes of
                                               // each page's warp, the rest by the loader when it publishes the item)
    unsigned long long free_[MK_PAGE_SLOTS];   // an item's epilogue is written
    long long stamp[MK_PAGE_SLOTS][5];         // (MK_PROFILE) claim, issued, waited, landed, computed (per item)
#if PG_STATS
    unsigned long long pstat[MK_PAGE_SLOTS][4];   // (MK_PG_PAGE_STATS) the item's page sums (ns), its marks
    long long pissue[MK_PAGE_MAX];             // when the ring page's current copy was issued
#endif
    int page[MK_PAGE_MAX][2];                  // item slot (-1: end marker), first row | rows << 16
    int item[MK_PAGE_SLOTS][12];               // sequence j, kind, expert slot, expert, first pair, r0, nr, K, pages,
                                               // rows in half 0, queue item, input rows
    float w[MK_PAGE_SLOTS][MB];                // a down item's pairs' routing weights
    int rank[MK_PAGE_SLOTS][MB];               // and their ranks among their rows' experts
    int done[MK_PAGE_SLOTS];                   // pages of the slot's item counted (atomics: elects the epilogue's warp)
    int stop;                                  // a wait failed (aborted step): every warp leaves
    int issued;                                // pages (and end markers) the loader issued
#if MK_PG_MULTI_ISSUE || MK_PG_ANY_SLOT
    int seq[MK_PAGE_MAX];                      // the ring page's last issued sequence number (-1: none; ANY_SLOT: its
                                               // lap count, written once the loader is done)
#endif
    const bf16* o_bias;                        // the layer's O-projection bias or null (the loader writes it before
                                               // its first item: O epilogues read no table after their wait)
};
static_assert(sizeof(PgState) <= MK_PAGE_STATE_BYTES, "opcodes.PAGE_STATE_BYTES is too small for PgState");

__device__ __forceinline__ PgState& pg_state(const Params& P) {
    return *reinterpret_cast<PgState*>(smem + PI(pg_state_off));
}
__device__ __forceinline__ int pg_ld(const int& v) { return ld_volatile(&v); }

#if MK_PROFILE
// Lane 0 of the warp that wrote item slot q's epilogue: the item's profiling record (PF_* layout, as prof_record),
// its stamps from the slot (claim: the loader decoded it; issued: its first page's copy; waited: its input row
// loaded; landed: its first page's math began; computed: its last page's math ended; end: now).
__device__ __forceinline__ void pg_prof_item(const Params& P, PgState& G, int l, int m, int q) {
    const int* it = G.item[q];
    const int kind = it[1], item = it[10];
    long long* r = PP(long long*, prof_items) + ((size_t)m * PI(prof_items_per_layer) + item) * MK_PROF_INTS;
    r[PF_BLOCK] = blockIdx.x; r[PF_SM] = smid();
    r[PF_OP] = kind == 0 ? MK_PROF_ITEM_GU : kind == 1 ? MK_PROF_ITEM_DN : MK_PROF_ITEM_O;
    r[PF_LAYER] = l;
    r[PF_ARG] = kind == 2 ? (long long)item : ((long long)it[3] << 16) | item;
    const long long* st = G.stamp[q];
    r[PF_CLAIM] = st[0]; r[PF_ISSUED] = st[1]; r[PF_WAITED] = st[2];
    r[PF_LANDED] = st[3] > st[2] ? st[3] : st[2]; r[PF_COMPUTED] = st[4] > r[PF_LANDED] ? st[4] : r[PF_LANDED];
    r[PF_END] = prof_now();
#if PG_STATS
    for (int k = 0; k < MK_PROF_N_MARKS; k++) r[PF_M0 + k] = k < 4 ? (long long)G.pstat[q][k] : -1;
#else
    for (int k = 0; k < MK_PROF_N_MARKS; k++) r[PF_M0 + k] = -1;
#endif
}
#endif

enum { PG_GU = 0, PG_DN = 1, PG_O = 2 };

// (MK_PROFILE) mark k of the worker's task record (opcodes.PROF_MARKS["MOE_WORKER"]), stamped by whichever thread
// gets there: where a worker's time goes before its first item and after its closing barrier.
__device__ __forceinline__ void pg_mark(int k) {
#if MK_PROFILE
    s_pmark[k] = prof_now();
#endif
}

#if MK_STALL_PRINT
// (MK_STALL_PRINT) a paged wait left: why (0: the worker stopped, 1: the step was aborted, 2: this wait's watchdog).
// Not inlined, as pg_stall_report.
__device__ __noinline__ void pg_spin_report(int ticket, int what, int seq, int why) {
    printf("mk stall: block %d task %d warp %d left paged wait %d (sequence %d): %s\n", blockIdx.x, ticket,
           (int)(threadIdx.x >> 5), what, seq, why == 0 ? "the worker stopped" : why == 1 ? "abort" : "watchdog");
}
#endif

#if MK_STALL_PRINT
// (MK_STALL_PRINT) an aborted worker's closing drain: whether page i's last phase (sequence s) was complete at the
// drain's first try, and the barrier's raw word then.
__device__ __noinline__ void pg_drain_report(PgState& G, int i, int s, bool done) {
    printf("mk stall:   block %d drain page %d sequence %d: %s at the first try, full %016llx\n", blockIdx.x, i, s,
           done ? "complete" : "not complete", *(volatile unsigned long long*)&G.full[i]);
}
#endif

// Lane 0 of a spinning warp: whether to leave its spin. Every wait in the worker is on another warp of this block or
// on a copy, so a protocol bug would spin forever where a counter wait times out: every 1024 asks the spin also reads
// the step's abort flag (another block's watchdog) and its clock, and past the watchdog it records ERR_STALL (which
// wait: STALL_*, and its sequence number) and aborts the step, so the host reports the stall instead of waiting on a
// kernel that never ends. G.stop (set here or by a failed counter wait) makes every role leave.
struct PgSpin {
    unsigned long long t0 = 0;
    unsigned n = 0;
    __device__ __forceinline__ bool leave(const Params& P, PgState& G, int ticket, int what, int seq) {
        if (pg_ld(G.stop)) {
#if MK_STALL_PRINT
            pg_spin_report(ticket, what, seq, 0);
#endif
            return true;
        }
        if ((++n & 1023u) != 0) return false;
        if (ld_volatile(PP(const int*, ctrl) + CTRL_ABORT)) {
#if MK_STALL_PRINT
            pg_spin_report(ticket, what, seq, 1);
#endif
            ((volatile int*)&G.stop)[0] = 1;
            return true;
        }
        const unsigned long long now = globaltimer();
        if (t0 == 0) {
            t0 = now;
        } else if (now - t0 > (unsigned long long)PL(watchdog_ns)) {
#if MK_STALL_PRINT
            pg_spin_report(ticket, what, seq, 2);
#endif
            record_error(P, MK_ERR_STALL, ticket, -1, what, seq);
            ((volatile int*)&G.stop)[0] = 1;
            return true;
        }
        return false;
    }
};

#if MK_STALL_PRINT
// Lane 0 of a warp that left a paged wait (MK_STALL_PRINT): the barrier's raw word (its phase bit and counts), the
// loader's end count (G.issued: set once its end markers are out), the canary and, for a ring page's wait (the
// sequence number then maps to the page), both its barriers and its entry. Not inlined: the printf's arguments stay
// out of the waits' registers.
__device__ __noinline__ void pg_stall_report(const Params& P, PgState& G, unsigned long long* bar, unsigned parity,
                                             int what, int seq) {
    const int* before = reinterpret_cast<const int*>(&G) - 2;   // (the 8 bytes before PgState: the x buffer's end,
                                                                 // or the outputs' or padding under pg_x_item)
    printf("mk stall:   block %d warp %d wait %d sequence %d parity %u: barrier %016llx, issued %d; canary %08x "
           "%08x, before %08x %08x, state at %d\n", blockIdx.x, (int)(threadIdx.x >> 5), what, seq, parity,
           *(volatile unsigned long long*)bar, pg_ld(G.issued), (unsigned)pg_ld(G.canary[0]),
           (unsigned)pg_ld(G.canary[3]), (unsigned)pg_ld(before[0]), (unsigned)pg_ld(before[1]), PI(pg_state_off));
    if (what == STALL_PAGE || what == STALL_EMPTY) {   // (a ring page's wait: its sequence number names the page)
        const int sl = seq % PI(pg_n);
        printf("mk stall:   block %d warp %d page %d: full %016llx empty %016llx entry %d %08x\n", blockIdx.x,
               (int)(threadIdx.x >> 5), sl, *(volatile unsigned long long*)&G.full[sl],
               *(volatile unsigned long long*)&G.empty[sl], pg_ld(G.page[sl][0]), (unsigned)pg_ld(G.page[sl][1]));
    }
}
#endif

// One warp, uniformly: lane 0 waits for the phase of `parity` (or an abort), then every lane observes it (at once:
// the phase cannot move on before this warp acts). Lanes must not leave a wait at different times: the warp's later
// shuffles need every lane at the same instruction.
__device__ __forceinline__ bool pg_wait(const Params& P, PgState& G, int ticket, unsigned long long* bar,
                                        unsigned parity, int what, int seq) {
    int ok = 1;
    if ((threadIdx.x & 31) == 0) {
        PgSpin spin;
        while (!mbar_try_wait(bar, parity))
            if (spin.leave(P, G, ticket, what, seq)) { ok = 0; break; }
#if MK_STALL_PRINT
        if (!ok) pg_stall_report(P, G, bar, parity, what, seq);
#endif
    }
    ok = __shfl_sync(0xffffffffu, ok, 0);
    if (ok) mbar_wait(bar, parity);
    return ok != 0;
}
// MK_PG_POLL_CHECK (MK_PG_MULTI_ISSUE and MK_PG_ANY_SLOT builds): a polling lane asks PgSpin whether to leave only
// every this-many-th failed poll (so the abort flag and the watchdog are read every MK_PG_POLL_CHECK * 1024 polls
// there, ~1 ms, against a watchdog of seconds). Each ask reads G.stop from shared memory beside the lanes' test_wait,
// which never suspends (unlike pg_wait's try_wait). On the H100 (speed_20261207s38 call 1, each build in its own
// process, twice) 32 against 1: b1 8K 3.325 / 3.322 against 3.352 / 3.348 ms, 1K 3.169 / 3.169 against 3.199 / 3.188
// (-0.6 to -0.9%), b8 and b16 even: a part of MULTI_ISSUE's one-row loss there (the default build: 3.286 / 3.277,
// 3.095 / 3.090).
#ifndef MK_PG_POLL_CHECK
#define MK_PG_POLL_CHECK 32
#endif
static_assert(MK_PG_POLL_CHECK >= 1 && (MK_PG_POLL_CHECK & (MK_PG_POLL_CHECK - 1)) == 0,
              "MK_PG_POLL_CHECK: a power of two");
// MK_PG_POLL_SUSPEND (pg_poll_own: MK_PG_MULTI_ISSUE's rounds, and MK_PG_ANY_SLOT's end markers): after a sweep of the
// polling lanes in which no ring page was free, the lowest lane still waiting suspends in try_wait on its page (ring
// pages free roughly in sequence order, so it is usually the next to free; the warp waits with it, up to the hardware's
// suspend limit, which also stretches the time between MK_PG_POLL_CHECK's asks) before the next sweep (1); or the lanes
// sweep with test_wait without pause (0). Tried because in the H100's page stats (speed_20261207s38 call 1, b1 8K) the
// computing warps' math per down item grew from 13.2 to 17.4 us (median page sum) under MULTI_ISSUE's busy sweeps.
// Measured on the H100 (call 2, each build in its own process, twice): b1 8K 3.367 / 3.361 against 3.325 / 3.322 ms
// without it, 1K 3.206 / 3.208 against 3.175 / 3.180 (+0.9 to +1.3%), b8 and b16 even; the math sums barely moved (down
// items 16.7 against 17.4 us, O items 31.0 against 29.9, page sums; the default's 13.2 and 24.4), so the sweeps were
// not what slowed the math (a hypothesis: more pages land together, so more warps compute at once). 0.
#ifndef MK_PG_POLL_SUSPEND
#define MK_PG_POLL_SUSPEND 0
#endif
#if MK_PG_MULTI_ISSUE || MK_PG_ANY_SLOT
// The loader warp, uniformly: each lane with `mine` polls its own ring page's `empty` phase `par` (at `bar`;
// `first_lap`: the page's first lap, which waits on nothing) with test_wait (non-blocking, so a lane whose page is
// free goes on at once) and runs act() on it; the warp loops until every such lane has (MK_PG_POLL_SUSPEND: a sweep
// that freed nothing suspends on the lowest waiting lane's page). False (every lane) if a lane's spin gave up (`seq`:
// its stall record). MULTI_ISSUE's rounds (pg_poll_lanes) and ANY_SLOT's end markers.
template <class Act>
__device__ __forceinline__ bool pg_poll_own(const Params& P, PgState& G, int ticket, bool mine, bool first_lap,
                                            unsigned long long* bar, unsigned par, int seq, Act&& act) {
    bool failed = false;
    PgSpin spin;
    unsigned polls = 0;
    while (__any_sync(0xffffffffu, mine)) {
        [[maybe_unused]] bool issued = false;   // (read under MK_PG_POLL_SUSPEND only)
        if (mine) {
            if (first_lap || mbar_test_wait(bar, par)) {
                act();
                mine = false;
                issued = true;
            } else if ((++polls & (MK_PG_POLL_CHECK - 1)) == 0 && spin.leave(P, G, ticket, STALL_EMPTY, seq)) {
                failed = true;
                mine = false;
            }
        }
#if MK_PG_POLL_SUSPEND
        const unsigned waiting = __ballot_sync(0xffffffffu, mine);
        // (the try_wait's result is not used: the next sweep's test_wait acts on it, and a lane that gives up does so
        // there, after at most the hardware's suspend limit)
        if (!__any_sync(0xffffffffu, issued) && waiting && (threadIdx.x & 31) == __ffs(waiting) - 1)
            (void)mbar_try_wait(bar, par);
#endif
    }
    return !__any_sync(0xffffffffu, failed);
}
#endif
#if MK_PG_MULTI_ISSUE
// MULTI_ISSUE's round: lane i < n takes sequence number s0 + i (n <= npg: distinct ring pages) and runs act(sq) once
// that ring page's previous lap is free.
template <class Act>
__device__ __forceinline__ bool pg_poll_lanes(const Params& P, PgState& G, int ticket, int s0, int n, int npg,
                                              Act&& act) {
    const int sq = s0 + (threadIdx.x & 31);
    return pg_poll_own(P, G, ticket, (threadIdx.x & 31) < n, sq < npg, &G.empty[sq % npg], ((sq / npg) - 1) & 1, sq,
                       [&] { act(sq); });
}
#endif
#if MK_PG_ANY_SLOT
// The loader warp, uniformly (MK_PG_ANY_SLOT): the lowest ring page free now into `slot`. Lane i < npg tests ring page
// i's last lap (`lap`: its issues so far; the first lap waits on nothing) with test_wait, which never suspends, so the
// sweep sees every page that frees; lane 0 asks PgSpin every MK_PG_POLL_CHECK-th empty sweep. False (every lane) if
// the spin gave up (`seq`: the page's sequence number, for the stall record).
__device__ __forceinline__ bool pg_any_free(const Params& P, PgState& G, int ticket, int npg, int lap, int seq,
                                            int& slot) {
    const int lane = threadIdx.x & 31;
    PgSpin spin;
    unsigned polls = 0;
    while (true) {
        const bool fr = lane < npg && (lap == 0 || mbar_test_wait(&G.empty[lane], (unsigned)(lap - 1) & 1u));
        const unsigned m = __ballot_sync(0xffffffffu, fr);
        if (m) {
            slot = __ffs(m) - 1;
            return true;
        }
        int leave = 0;
        if (lane == 0 && (++polls & (MK_PG_POLL_CHECK - 1)) == 0) leave = spin.leave(P, G, ticket, STALL_EMPTY, seq);
        if (__shfl_sync(0xffffffffu, leave, 0)) return false;
    }
}
#endif

__device__ __forceinline__ void pg_compute(const bf16* W, const bf16* x, int nr, int K, float* out) {
#if MK_PG_SEG_TC
    // the widest segmenting that fits: nr * S <= 16 A rows, K in whole 32-element steps per segment
    if (nr <= 2 && K % 256 == 0) { pg_rows_seg<8>(W, x, nr, K, out); return; }
    if (nr <= 4 && K % 128 == 0) { pg_rows_seg<4>(W, x, nr, K, out); return; }
    if (nr <= 8 && K % 64 == 0) { pg_rows_seg<2>(W, x, nr, K, out); return; }
    if (nr <= 16 && K % 32 == 0) { pg_rows_seg<1>(W, x, nr, K, out); return; }
#endif
    if (nr <= 2) pg_rows<2>(W, x, nr, K, out);
    else if (nr <= 4) pg_rows<4>(W, x, nr, K, out);
    else if (nr <= 8) pg_rows<8>(W, x, nr, K, out);
    else pg_rows<MK_PAGE_ROWS_MAX>(W, x, nr, K, out);
}

static_assert(MK_MAX_BATCH <= 16, "pg_compute_rows_tc holds at most 16 input rows (rows g and g + 8)");

// One warp: n 16-byte chunks from global memory (L2) into shared memory, every lane's copies in flight at once
// (cp.async; a plain load-then-store loop issued a few loads per round trip: the 8 x rows of a b8 layer took ~25 us),
// landed and visible to the warp's lanes when it returns.
__device__ __forceinline__ void pg_copy_rows(unsigned char* dst, const void* src, int n) {
    const int lane = threadIdx.x & 31;
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* sv = reinterpret_cast<const uint4*>(src);
    for (int c = lane; c < n; c += 32) cp_async16(d + c, sv + c);
    cp_async_commit();
    cp_async_wait_all();
    __syncwarp();
}

// The input warp (lane 0 waits): item slot q's input rows, after their dependency (a down item: its expert's
// gate/up items; an O item: the attention combines), by cp.async (pg_copy_rows) into the slot's input buffer, and a
// down item's pairs' weights and ranks. A gate/up item: its pairs' x rows where the plan has pg_x_item (no wait: x
// was final before the routing the worker waited for), else nothing (it reads the layer's x rows, loaded at the
// worker's start). False if the wait failed.
__device__ __forceinline__ bool pg_load_inputs(const Params& P, PgState& G, int ticket, int l, int m, int q) {
    const int lane = threadIdx.x & 31;
    const int* it = G.item[q];
    const int kind = it[1], eslot = it[2], st = it[4], K = it[7], nc = it[11];
    if (kind == PG_GU) {
        if (!PI(pg_x_item)) return true;
        const uint4* x = reinterpret_cast<const uint4*>(PP(const bf16*, x) + (size_t)l * PI(Bm) * PI(H));
        uint4* d = reinterpret_cast<uint4*>(smem + PI(pg_in_off) + (size_t)q * PI(pg_in_bytes));
        const int kc = K >> 3;                // (K = H: 16-byte chunks per row; every lane's copies in flight)
        for (int c = lane; c < nc * kc; c += 32) {
            const int i = c / kc;
            cp_async16(d + c, x + (size_t)s_route_row[st + i] * kc + (c - i * kc));
        }
        cp_async_commit();
        cp_async_wait_all();
        __syncwarp();
        return true;
    }
    int ok = 1;
    if (lane == 0) {
        if (kind == PG_DN) ok = wait_counter(P, l * PI(cpl) + PI(c_gu) + eslot, PI(gu_tiles), ticket) ? 1 : 0;
        else ok = wait_counter(P, l * PI(cpl) + PI(c_comb), PI(B) * PI(n_kv) * PI(combine_parts), ticket) ? 1 : 0;
    }
    ok = __shfl_sync(0xffffffffu, ok, 0);
    if (!ok) return false;
    __syncwarp();                             // (lane 0's acquire of the counter orders the lanes' loads below)
    if (kind == PG_DN) {                      // the pairs' weights and ranks (route_to_shared's, read at the start)
        for (int i = lane; i < nc; i += 32) {
            G.w[q][i] = __uint_as_float((unsigned)s_route_pw[st + i] << 16);
            G.rank[q][i] = s_route_rank[st + i];
        }
    }
    // a down item's pairs' activation rows (consecutive pairs: consecutive rows), an O item's rows of attention
    const bf16* src = kind == PG_DN ? PP(const bf16*, eact) + ((size_t)m * PI(n_pairs) + st) * PI(I)
                                    : PP(const bf16*, attn) + (size_t)l * PI(Bm) * PI(q_dim);
    pg_copy_rows(smem + PI(pg_in_off) + (size_t)q * PI(pg_in_bytes), src, nc * (K >> 3));
    return true;
}

// One warp: item slot q's epilogue from its fp32 outputs (a gate/up item's SiLU(gate) * up into eact and its
// counter's release; a down item's weighted rows into y; an O item's rows plus the bias into ao). (Freeing a gate/up
// item's slot before its release instead, MK_PG_FREE_EARLY, measured even: session 24; removed in session 26.)
__device__ __forceinline__ void pg_epilogue(const Params& P, PgState& G, int l, int m, int q) {
    const int lane = threadIdx.x & 31;
    const int* it = G.item[q];
    const int kind = it[1], eslot = it[2], st = it[4], r0 = it[5], nr = it[6], nc = it[11];
    const int os = PI(pg_out_rows);           // input row i's outputs at out[i * os ...]
    const float* out = reinterpret_cast<const float*>(smem + PI(pg_out_off)) + (size_t)q * PI(pg_rows) * os;
    const int H = PI(H);
    if (kind == PG_GU) {
        for (int i = 0; i < nc; i++) {
            bf16* dst = PP(bf16*, eact) + ((size_t)m * PI(n_pairs) + st + i) * PI(I) + r0;
            const float* oi = out + (size_t)i * os;
            for (int r = lane; r < nr; r += 32) {
                const float g = rbf(oi[r]), u = rbf(oi[nr + r]);
                dst[r] = f2bf(rbf(g / (1.f + expf(-g))) * u);
            }
        }
        __syncwarp();
        if (lane == 0) {
            red_release(PP(int*, counters) + l * PI(cpl) + PI(c_gu) + eslot, 1);
        }
    } else if (kind == PG_DN) {
        for (int i = 0; i < nc; i++) {
            const float w = G.w[q][i];
            const int row = s_route_row[st + i], rank = G.rank[q][i];
            bf16* y = PP(bf16*, y) + (((size_t)m * PI(Bm) + row) * PI(topk) + rank) * H + r0;
            const float* oi = out + (size_t)i * os;
            for (int r = lane; r < nr; r += 32) y[r] = f2bf(rbf(oi[r]) * w);
        }
    } else {
        const bf16* bias = G.o_bias;
        for (int i = 0; i < nc; i++) {
            bf16* o = PP(bf16*, ao) + ((size_t)l * PI(Bm) + i) * H + r0;
            const float* oi = out + (size_t)i * os;
            for (int r = lane; r < nr; r += 32) {
                float v = oi[r];
                if (bias) v += bf2f(bias[r0 + r]);
                o[r] = f2bf(v);
            }
        }
    }
}

// One warp, once item slot q's pages are all computed (its `outs` phase): the item's epilogue (and its profiling
// record), every lane's stores done when it returns; the caller then frees the slot (`free_`).
__device__ __forceinline__ void pg_finish_item(const Params& P, PgState& G, int l, int m, int q) {
#if MK_PROFILE
    if ((threadIdx.x & 31) == 0) G.stamp[q][4] = prof_now();
#endif
    pg_epilogue(P, G, l, m, q);
    __syncwarp();
#if MK_PROFILE
    if ((threadIdx.x & 31) == 0) pg_prof_item(P, G, l, m, q);
#endif
}

// All threads (then a block barrier: the caller's): the worker's barriers and bookkeeping. Lane 0 of warp w sets up
// the barriers of pages w, w + NW, ... and of item slots w, w + NW, ..., in parallel across warps: by thread 0 alone
// the inits (and at the end the invalidations; 27 each at 12 pages) ran in series, and the trace put ~3.7 us between
// a paged worker's wait and its first item (1.3 for the plain worker) and ~2.6 us after its closing barrier. With
// pg_early the worker task runs this before its dependency wait (nothing of the block's is in flight then: a MoE
// worker is not a GEMV, so no prefetch targets it), so only the route read stands between TOPK and its first item.
__device__ __noinline__ void pg_setup(const Params& P) {
    const int npg = PI(pg_n);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    PgState& G = pg_state(P);
    if (lane == 0) {
        for (int i = warp; i < npg; i += NW) {
            mbar_init(&G.full[i], 1);
            mbar_init(&G.empty[i], MK_PG_PAGE_WARPS);   // (each of its warps frees it)
#if MK_PG_MULTI_ISSUE
            G.seq[i] = -1;
#endif
        }
        for (int q = warp; q < MK_PAGE_SLOTS; q += NW) {
            mbar_init(&G.desc[q], 1);
            mbar_init(&G.inp[q], 32);         // (every lane of the input warp arrives: each releases its own copies)
            mbar_init(&G.outs[q], MK_PAGE_OUT_ARRIVALS);
            mbar_init(&G.free_[q], 1);
            G.done[q] = 0;
        }
        if (warp == 0) { G.stop = 0; G.issued = 0; }
#if MK_STALL_PRINT
        if (warp == 0) for (int i = 0; i < 4; i++) G.canary[i] = 0x5a5a0000 + i;
#endif
        fence_mbar_init();
    }
}

// All threads, after the worker waited for the routing and claimed its first item: the layer's items on the ring.
// Returns false if a wait failed (the step is aborted); every copy it issued has landed when it returns.
__device__ __noinline__ bool moe_worker_pages(const Params& P, int ticket, int l, int m, const int* route,
                                              const bf16* egu, const bf16* edn, const bf16* obias, const bf16* ow,
                                              int n_gu, int n_items, int first_item) {
    const int npg = PI(pg_n);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (!smem_fits(P, (size_t)PI(pg_state_off) + sizeof(PgState), ticket)) return false;
    if (npg * MK_PG_PAGE_WARPS > NW - 2) {    // (MK_PG_PAGE_WARPS computing warps per ring page: the plan keeps
                                              // pg_n * page_warps <= NW - 2)
        if (threadIdx.x == 0) record_error(P, MK_ERR_SMEM, ticket, -1, npg * MK_PG_PAGE_WARPS, NW - 2);
        return false;
    }
    PgState& G = pg_state(P);
    if (threadIdx.x == 0) pg_mark(0);
    if (!PI(pg_early) || PI(worker_topk)) {   // (else task_moe_worker ran it before its wait)
        pg_setup(P);
        __syncthreads();
    }
    if (threadIdx.x == 0) pg_mark(1);
    // item j's phase of an item slot's barriers (items q, q + SLOTS, ... complete its phases 0, 1, ...)
    auto slot_parity = [](int j) { return (unsigned)(j / MK_PAGE_SLOTS) & 1u; };
    if (warp == PG_LOADER_WARP) {             // ---- the loader ----
        const unsigned long long pol = l2_evict_first();
#if MK_PG_TLB_WARM == 1 || MK_PG_TLB_WARM == 2
        // (the layer's routed experts, one per gate/up slot, before the first copy)
        warm_expert_regions(P, egu, edn, n_gu / PI(gu_tiles), [](int x) { return s_route_slot[x] & 511; }, lane, 32,
                            MK_PG_TLB_WARM, pol);
#endif
#if !MK_PG_PROXY_FENCE
        // the ring's first lap has no `empty` wait: its pages overlap what earlier tasks of this block wrote and read
        // by generic accesses (the GEMV scratch at offset 0, tiles, attention chunks), ordered before this lane by
        // the block barriers; one proxy fence orders them before every copy it issues, as issue_weights_w0 does
        if (lane == 0 || MK_PG_MULTI_ISSUE || MK_PG_ANY_SLOT) fence_proxy_async();   // (MULTI_ISSUE, ANY_SLOT: any
                                                                                      // lane issues copies)
#endif
        int item = first_item, j = 0, s = 0;
#if MK_PG_ANY_SLOT
        int lap = 0;                          // (lane i < npg: ring page i's copies and end markers so far)
#endif
#if MK_PG_RING_COUNTERS
        int ring_slot = 0, ring_lap = 0;      // (s % npg and s / npg, stepped with s)
#endif
        int* work = PP(int*, moe_work) + m;
        bool stop = false;
        if (lane == 0) G.o_bias = obias;      // (published with the first item's description)
        // l2_prefetch & L2PF_NEXT_INPUTS: at this worker's first down item (~20 us before the next layer's head), the
        // long-lived inputs of the next layer's fused norms into L2: this layer's residual rows h (written ~45 us
        // before they are read there) and the next layer's norm weights (lane 0; the table's load lands long before)
        const int pf_bits = PI(l2_pf);
        const char* next_norm = nullptr;
        if ((pf_bits & MK_L2PF_NEXT_INPUTS) && l + 1 < PI(L) && lane == 0)
            next_norm = reinterpret_cast<const char*>(layer_wptr(P, l + 1)[WP_NORM]);
#if PG_STATS
        long long t_decoded = 0;              // the decode's start (after the slot's wait; before it: DECODE_EARLY)
#endif
        // Item j (`item`) into slot j % PAGE_SLOTS once the slot's previous item is done (`free_`), then its pages;
        // lane 0 claims an item into `claim` on the way. False once the loader is done: the end item published, or a
        // wait failed (stop).
        const auto run_item = [&](int& claim) -> bool {
            const bool end = item >= n_items;
            const int q = j % MK_PAGE_SLOTS;
#if MK_PG_DECODE_EARLY
#if PG_STATS
            t_decoded = prof_now();           // (the decode's start, before the slot's wait)
#endif
            // the item's decode needs no slot: before the slot's wait, which it then overlaps
            MoeItem it{};
            if (!end) it = moe_item(P, l, route, egu, edn, item, n_gu, ow);
            const int K = end ? 1 : it.T.K;
            const int rpp = min(MK_PAGE_BYTES / (K * 2), MK_PAGE_ROWS_MAX);
            const int n0 = it.T.n0, n1 = it.T.n1;
            const int pages = end ? 0 : (n0 + rpp - 1) / rpp + (n1 + rpp - 1) / rpp;
#endif
            if (j >= MK_PAGE_SLOTS
                && !pg_wait(P, G, ticket, &G.free_[q], slot_parity(j - MK_PAGE_SLOTS), STALL_SLOT, j)) {
                stop = true;
                return false;
            }
#if PG_STATS && !MK_PG_DECODE_EARLY
            t_decoded = prof_now();
#endif
            if (end) {                        // the end item: the input warp stops there
                if (lane == 0) { G.item[q][0] = j; G.item[q][1] = PG_END; mbar_arrive(&G.desc[q]); }
                return false;
            }
#if !MK_PG_DECODE_EARLY
            const MoeItem it = moe_item(P, l, route, egu, edn, item, n_gu, ow);
            const int K = it.T.K;
            const int rpp = min(MK_PAGE_BYTES / (K * 2), MK_PAGE_ROWS_MAX);
            const int n0 = it.T.n0, n1 = it.T.n1;
            const int pages = (n0 + rpp - 1) / rpp + (n1 + rpp - 1) / rpp;
#endif
            // (`outs` counts 32 arrivals per page warp; the plan bounds an item's pages)
            if (pages < 1 || pages * MK_PG_PAGE_WARPS > MK_PAGE_ITEM_PAGES_MAX) {
                if (lane == 0)
                    record_error(P, MK_ERR_SMEM, ticket, -1, pages * MK_PG_PAGE_WARPS, MK_PAGE_ITEM_PAGES_MAX);
                stop = true;
                return false;
            }
            if (it.cnt > PI(pg_rows)) {       // (an item slot holds pg_rows input and output rows; the routing's
                if (lane == 0) record_error(P, MK_ERR_SMEM, ticket, -1, it.cnt, PI(pg_rows));   // slot_pairs bounds
                stop = true;                                                                   // an expert's slot)
                return false;
            }
            if (lane == 0) {
                int* mt = G.item[q];
                mt[0] = j; mt[1] = it.slot < 0 ? PG_O : it.down ? PG_DN : PG_GU; mt[2] = it.slot; mt[3] = it.e;
                mt[4] = it.st; mt[5] = it.r0; mt[6] = it.nr; mt[7] = K; mt[8] = pages; mt[9] = n0; mt[10] = item;
                mt[11] = it.cnt;
#if MK_PROFILE
                G.stamp[q][0] = prof_now();
                if (j == 0) pg_mark(2);
#endif
#if PG_STATS
                G.pstat[q][0] = (unsigned long long)(prof_now() - t_decoded) << 32;
                G.pstat[q][1] = 0;
                G.pstat[q][2] = 0;
                G.pstat[q][3] = 0;
#endif
                // the arrivals `outs` will not get from pages (the plan keeps an item's pages within the count)
                if (pages * MK_PG_PAGE_WARPS < MK_PAGE_ITEM_PAGES_MAX)
                    mbar_arrive_n(&G.outs[q], MK_PAGE_OUT_ARRIVALS - 32 * MK_PG_PAGE_WARPS * pages);
                mbar_arrive(&G.desc[q]);      // (release: the description before the input warp's reads)
                if (next_norm && it.down) {   // (once: the first down item)
                    const unsigned long long pol = l2_policy_prefetched(pf_bits & MK_L2PF_EVICT_LAST);
                    l2_prefetch_bulk(PP(const bf16*, h) + (size_t)l * PI(Bm) * PI(H), (unsigned)(PI(B) * PI(H) * 2),
                                     pol);
                    l2_prefetch_bulk(next_norm, (unsigned)(PI(H) * 2), pol);
                    next_norm = nullptr;
                }
            }
            const bool late = PI(pg_claim_late) != 0;
            const int pages0 = (n0 + rpp - 1) / rpp;   // the first half's pages (gate rows, or all)
#if MK_PG_MULTI_ISSUE
            // lane 0's description (and stats resets) before any lane's page release: the computing warps read the
            // item's fields after acquiring a page's `full`, which lane i now arrives on (vote and shuffle order no
            // memory; __syncwarp does)
            __syncwarp();
            // this lane's sequence number sq (the item's page p = sq - s) into ring page sq % npg (its previous lap
            // free): the entry and the copy
            const auto issue_lane = [&](int sq) {
                const int p = sq - s;
                const int h = p < pages0 ? 0 : 1, r = (h ? p - pages0 : p) * rpp;
                const int nr = min(rpp, (h ? n1 : n0) - r);
                const bf16* src = h ? it.T.w1 : it.T.w0;
                const int slot = sq % npg;
#if MK_PROFILE
                if (p == 0) G.stamp[q][1] = prof_now();   // (before the arrive that releases it)
#endif
                G.page[slot][0] = q;
                G.page[slot][1] = (h * n0 + r) | (nr << 16);
                G.seq[slot] = sq;
#if PG_STATS
                G.pissue[slot] = prof_now();
#endif
#if MK_PG_PROXY_FENCE
                fence_proxy_async();
#endif
                mbar_expect_tx(&G.full[slot], (unsigned)(nr * K * 2));
                bulk_load(smem + (size_t)slot * MK_PAGE_BYTES, src + (size_t)r * K, (unsigned)(nr * K * 2),
                          &G.full[slot], pol);
            };
            // pages lo .. hi - 1 (at most npg), lane i page lo + i, each issued as soon as its ring page is free
            const auto poll = [&](int lo, int hi) {
#if PG_STATS
                const long long t_ready = prof_now();
#endif
                stop = !pg_poll_lanes(P, G, ticket, s + lo, hi - lo, npg, [&](int sq) {
#if PG_STATS
                    const long long t_issue = prof_now();
                    atomicAdd(&G.pstat[q][3], (unsigned long long)(t_issue - t_ready));
#endif
                    issue_lane(sq);
#if PG_STATS
                    atomicAdd(&G.pstat[q][2], (unsigned long long)(prof_now() - t_issue) << 32);
#endif
                });
            };
            // rounds of npg pages; the claim MK_PG_CLAIM_LEAD pages before the item's end, as the one-page loop makes
            // it, once every page before that is issued (the round split there: its pages free in order anyway)
            const int claim_at = MK_PG_CLAIM_LEAD == 0 ? pages / 2
                                 : pages > MK_PG_CLAIM_LEAD ? pages - MK_PG_CLAIM_LEAD : 0;
            for (int base = 0; base < pages && !stop; base += npg) {
                const int end = min(pages, base + npg);
                if (!late && claim_at >= base && claim_at < end) {
                    poll(base, claim_at);
                    if (!stop && lane == 0) claim = atomicAdd(work, 1);   // (read after the item's pages: `take`)
                    if (!stop) poll(claim_at, end);
                } else {
                    poll(base, end);
                }
            }
            s += pages;
#else
#if MK_PG_ANY_SLOT
            // lane 0's description (and stats resets) before the issuing lane's release: the computing warps read the
            // item's fields after acquiring a page's `full`, which any lane may now arrive on (as MULTI_ISSUE above)
            __syncwarp();
#endif
            // page p of the item: rows r.. of half h into the next ring slot, once its previous lap is free
            const auto issue_page = [&](int p) {
                const int h = p < pages0 ? 0 : 1, r = (h ? p - pages0 : p) * rpp;
                const int nr = min(rpp, (h ? n1 : n0) - r);
                const bf16* src = h ? it.T.w1 : it.T.w0;
#if PG_STATS
                const long long t_ready = prof_now();
#endif
#if MK_PG_ANY_SLOT
                int slot = 0;                 // (the lowest free ring page; its lane, which counts its laps, issues)
                if (!pg_any_free(P, G, ticket, npg, lap, s, slot)) {
                    stop = true;
                    return;
                }
                const int issuer = slot;
#elif MK_PG_RING_COUNTERS
                const int slot = ring_slot, issuer = 0;
                if (ring_lap > 0
                    && !pg_wait(P, G, ticket, &G.empty[slot], (unsigned)(ring_lap - 1) & 1u, STALL_EMPTY, s)) {
                    stop = true;
                    return;
                }
#else
                const int slot = s % npg, issuer = 0;
                if (s >= npg && !pg_wait(P, G, ticket, &G.empty[slot], ((s / npg) - 1) & 1, STALL_EMPTY, s)) {
                    stop = true;
                    return;
                }
#endif
#if PG_STATS
                const long long t_issue = prof_now();
                if (lane == issuer) atomicAdd(&G.pstat[q][3], (unsigned long long)(t_issue - t_ready));
#endif
                if (lane == issuer) {
#if MK_PROFILE
                    if (p == 0) G.stamp[q][1] = prof_now();   // (before the arrive that releases it)
#endif
                    G.page[slot][0] = q;
                    G.page[slot][1] = (h * n0 + r) | (nr << 16);
#if PG_STATS
                    G.pissue[slot] = prof_now();   // (published by the expect_tx arrive below, as the entry)
#endif
#if MK_PG_PROXY_FENCE
                    fence_proxy_async();  // the page's last reads (its warp's) before the copy's writes
#endif
                    mbar_expect_tx(&G.full[slot], (unsigned)(nr * K * 2));
                    bulk_load(smem + (size_t)slot * MK_PAGE_BYTES, src + (size_t)r * K, (unsigned)(nr * K * 2),
                              &G.full[slot], pol);
#if MK_PG_ANY_SLOT
                    lap++;
#endif
#if PG_STATS
                    atomicAdd(&G.pstat[q][2], (unsigned long long)(prof_now() - t_issue) << 32);
#endif
                }
                s++;
#if MK_PG_RING_COUNTERS
                if (++ring_slot == npg) { ring_slot = 0; ring_lap++; }
#endif
            };
            // the claim MK_PG_CLAIM_LEAD pages before this item's end (its round trip under those pages' waits: the
            // loader reads the result after the item's last page, or an item later)
            const int claim_at = MK_PG_CLAIM_LEAD == 0 ? pages / 2
                                 : pages > MK_PG_CLAIM_LEAD ? pages - MK_PG_CLAIM_LEAD : 0;
            for (int p = 0; p < claim_at && !stop; p++) issue_page(p);
            if (!late && !stop && lane == 0) claim = atomicAdd(work, 1);
            for (int p = claim_at; p < pages && !stop; p++) issue_page(p);
#endif
            if (late && !stop) {              // claim_late: once this item's inputs are loaded (its dependency met)
                if (!pg_wait(P, G, ticket, &G.inp[q], slot_parity(j), STALL_CLAIM, j)) {
                    stop = true;
                    return false;
                }
                if (lane == 0) claim = atomicAdd(work, 1);
            }
            return !stop;
        };
        // The next item: lane 0's claim `next` (the shuffle waits for its atomic's result).
        const auto take = [&](int next) {
            item = __shfl_sync(0xffffffffu, next, 0);
            j++;
        };
        while (true) {
            int nxt = 0;
            if (!run_item(nxt)) break;
            take(nxt);
        }
        // One end marker per computing warp, each into its own page (the npg sequence numbers after the last page)
#if MK_PG_MULTI_ISSUE
        if (!stop) {                          // (lane i the marker of sequence number s + i, in one round)
            stop = !pg_poll_lanes(P, G, ticket, s, npg, npg, [&](int sq) {
                G.page[sq % npg][0] = -1;
                G.seq[sq % npg] = sq;
                mbar_arrive(&G.full[sq % npg]);
            });
            s += npg;
        }
#elif MK_PG_ANY_SLOT
        if (!stop) {                          // (lane i ring page i's marker, once its last lap is free)
            stop = !pg_poll_own(P, G, ticket, lane < npg, lap == 0, &G.empty[lane], (unsigned)(lap - 1) & 1u, s, [&] {
                G.page[lane][0] = -1;
                mbar_arrive(&G.full[lane]);
                lap++;
            });
            s += npg;
        }
        if (lane < npg) G.seq[lane] = lap;    // (also after a failed wait: the drain waits on each page's last lap)
#else
        for (int i = 0; i < npg && !stop; i++) {
#if MK_PG_RING_COUNTERS
            const int slot = ring_slot;
            if (ring_lap > 0
                && !pg_wait(P, G, ticket, &G.empty[slot], (unsigned)(ring_lap - 1) & 1u, STALL_EMPTY, s)) {
#else
            const int slot = s % npg;
            if (s >= npg && !pg_wait(P, G, ticket, &G.empty[slot], ((s / npg) - 1) & 1, STALL_EMPTY, s)) {
#endif
                stop = true;
                break;
            }
            if (lane == 0) { G.page[slot][0] = -1; mbar_arrive(&G.full[slot]); }
            s++;
#if MK_PG_RING_COUNTERS
            if (++ring_slot == npg) { ring_slot = 0; ring_lap++; }
#endif
        }
#endif
        // (also after a failed wait: what has been issued must land; under MULTI_ISSUE the count of sequence numbers
        // used, holes included, which the drain does not read: it waits on each page's `seq`)
        if (lane == 0) G.issued = s;
        if (stop && lane == 0) ((volatile int*)&G.stop)[0] = 1;
        __syncwarp();                         // (each role's warp meets the block barrier below converged)
    } else if (warp == PG_INPUT_WARP) {       // ---- the input warp ----
        // the layer's x rows (the gate/up items' inputs), before any item's inputs are announced (pg_x_item: each
        // gate/up item's own rows, with its inputs)
        if (!PI(pg_x_item))
            pg_copy_rows(smem + PI(pg_x_off), PP(const bf16*, x) + (size_t)l * PI(Bm) * PI(H), PI(B) * (PI(H) >> 3));
        for (int j = 0;; j++) {
            const int q = j % MK_PAGE_SLOTS;
            if (!pg_wait(P, G, ticket, &G.desc[q], slot_parity(j), STALL_ITEM, j)) break;
            if (G.item[q][1] == PG_END) break;
            const bool ok = pg_load_inputs(P, G, ticket, l, m, q);
            __syncwarp();                     // (the warp leaves together on a failed wait)
            if (!ok) {
                if (lane == 0) ((volatile int*)&G.stop)[0] = 1;
                break;
            }
#if MK_PROFILE
            if (lane == 0) G.stamp[q][2] = prof_now();
#endif
            mbar_arrive(&G.inp[q]);           // every lane (release: its copies, weights and ranks before the
                                              // computing warps' reads)
        }
        __syncwarp();
    } else if (warp < npg * MK_PG_PAGE_WARPS) {   // ---- the computing warps: warp w, ring page w % pg_n ----
        // (half: which of the page's rows under MK_PG_PAGE_WARPS = 2)
        const int slot = MK_PG_PAGE_WARPS == 1 ? warp : warp % npg, half = MK_PG_PAGE_WARPS == 1 ? 0 : warp / npg;
        for (int k = 0;; k++) {
#if PG_STATS
            const long long t_free = prof_now();
#endif
            if (!pg_wait(P, G, ticket, &G.full[slot], (unsigned)k & 1u, STALL_PAGE, slot + k * npg)) break;
#if PG_STATS
            const long long t_page = prof_now();
#endif
            int q = 0, pr = 0;                // (lane 0 alone reads the page's entry: the loader rewrites it once this
            if (lane == 0) { q = G.page[slot][0]; pr = G.page[slot][1]; }   // warp's lane 0 freed the page)
            q = __shfl_sync(0xffffffffu, q, 0);
            pr = __shfl_sync(0xffffffffu, pr, 0);
            if (q < 0) {                      // its end marker
                __syncwarp();
                if (lane == 0) mbar_arrive(&G.empty[slot]);
                break;
            }
            const int* it = G.item[q];
            // (the item's fields read now: once this warp's page is counted, another warp may finish the item and
            // the loader publish the next item in the slot)
            const int j = it[0], K = it[7], npages = it[8] * MK_PG_PAGE_WARPS;   // (page warps to count)
            // this warp's rows of the page: all, or (MK_PG_PAGE_WARPS = 2) the first (n + 1) / 2 or the rest
            const int pn = pr >> 16, h0 = MK_PG_PAGE_WARPS == 2 ? (pn + 1) >> 1 : pn;
            const int row0 = (pr & 0xffff) + (half ? h0 : 0), nr = half ? pn - h0 : h0;
            const int kind = it[1], st = it[4], nc = it[11];
            if (!pg_wait(P, G, ticket, &G.inp[q], slot_parity(j), STALL_INPUT, j)) break;
#if PG_STATS
            const long long t_inp = prof_now();
#endif
            // input row i: a gate/up item's pair i's row of the shared x rows (without pg_x_item), else row i of
            // the slot's input buffer
            const bf16* xin = reinterpret_cast<const bf16*>(smem + PI(pg_in_off) + (size_t)q * PI(pg_in_bytes));
            const bf16* xs = reinterpret_cast<const bf16*>(smem + PI(pg_x_off));
            const int os = PI(pg_out_rows), H = PI(H);
            float* out = reinterpret_cast<float*>(smem + PI(pg_out_off)) + (size_t)q * PI(pg_rows) * os;
#if MK_PROFILE
            if (lane == 0 && row0 == 0) G.stamp[q][3] = prof_now();   // (its first page landed)
#endif
            const bf16* W = reinterpret_cast<const bf16*>(smem + (size_t)slot * MK_PAGE_BYTES
                                                          + (size_t)(half ? h0 : 0) * K * 2);
            const bool shared_x = kind == PG_GU && !PI(pg_x_item);
            if (MK_PG_PAGE_WARPS == 2 && nr == 0) {
                // (a one-row page's second warp: nothing to multiply; it still arrives and counts)
            } else if (nc == 1) {
                pg_compute(W, shared_x ? xs + (size_t)s_route_row[st] * H : xin, nr, K, out + row0);
            } else {
                const auto xrow = [&](int i) {
                    return shared_x ? xs + (size_t)s_route_row[st + i] * H : xin + (size_t)i * K;
                };
                if (MK_GEMV_TC) pg_compute_rows_tc(W, nr, nc, K, xrow, out + row0, os);
                else pg_compute_rows(W, nr, nc, K, xrow, out + row0, os);
            }
#if PG_STATS
            if (lane == 0) {
                const long long t_math = prof_now();
                // a warp that waited for the page saw it land: its flight is issue to then
                const bool waited = t_page - t_free > 64;
                // (MK_PG_PAGE_WARPS = 2: the waits and the flight from the page's first warp only, so the sums stay
                // per page; the math from both, summed)
                if (half == 0) {
                    atomicAdd(&G.pstat[q][0], (unsigned long long)(t_page - t_free));
                    atomicAdd(&G.pstat[q][1], (unsigned long long)(t_inp - t_page) + (waited ? 1ull << 32 : 0ull));
                    if (waited) atomicAdd(&G.pstat[q][3], (unsigned long long)(t_page - G.pissue[slot]) << 32);
                }
                atomicAdd(&G.pstat[q][2], (unsigned long long)(t_math - t_inp));
            }
#endif
            mbar_arrive(&G.outs[q]);                  // every lane (release: its own output stores; the tensor-core
            __syncwarp();                             // product's lanes all store)
            int done = 0;
            if (lane == 0) {
                mbar_arrive(&G.empty[slot]);          // the page is free for the loader
                done = atomicAdd(&G.done[q], 1) == npages - 1;
            }
            done = __shfl_sync(0xffffffffu, done, 0);
            if (done) {                           // the item's last page counted: its epilogue, then its slot is free
                if (!pg_wait(P, G, ticket, &G.outs[q], slot_parity(j), STALL_OUTS, j)) break;
                pg_finish_item(P, G, l, m, q);
                if (lane == 0) { atomicExch(&G.done[q], 0); mbar_arrive(&G.free_[q]); }
            }
        }
        __syncwarp();
    }
    __syncthreads();
    if (threadIdx.x == 0) pg_mark(3);
    // every copy issued has landed before the ring's memory is anyone else's (an aborted worker's pages included)
    const bool ok = !G.stop;
    __syncthreads();
    if (lane == 0) {                          // (each page's last phase, then its barriers, by the warp that set them up)
#if !MK_PG_MULTI_ISSUE && !MK_PG_ANY_SLOT
        const int S = G.issued;
#endif
        for (int i = warp; i < npg; i += NW) {
#if MK_PG_MULTI_ISSUE
            const int s = G.seq[i];           // (a failed round may leave holes: each page's own last issue)
            if (s >= 0) mbar_wait(&G.full[i], (s / npg) & 1);
#elif MK_PG_ANY_SLOT
            const int n = G.seq[i];           // (its laps: the last one's phase)
            if (n > 0) mbar_wait(&G.full[i], (unsigned)(n - 1) & 1u);
#else
            if (S > i) {                      // page i's last sequence number: the largest s < S with s % npg == i
                const int s = i + npg * ((S - 1 - i) / npg);
#if MK_STALL_PRINT
                // (an aborted worker: whether the page's last phase, which a stuck wait gave up on, is complete now)
                if (!ok) pg_drain_report(G, i, s, mbar_try_wait(&G.full[i], (s / npg) & 1));
#endif
                mbar_wait(&G.full[i], (s / npg) & 1);
            }
#endif
            mbar_inval(&G.full[i]);
            mbar_inval(&G.empty[i]);
        }
        for (int q = warp; q < MK_PAGE_SLOTS; q += NW) {
            mbar_inval(&G.desc[q]);
            mbar_inval(&G.inp[q]);
            mbar_inval(&G.outs[q]);
            mbar_inval(&G.free_[q]);
        }
    }
    __syncthreads();
    return ok;
}
