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
#include "mk_pg_switches.cuh"   // the role warps and build switches (what each measured)
#include "mk_pg_sync.cuh"       // PgState and the waits
#include "mk_pg_items.cuh"      // per-item work: page products, inputs, epilogues, set-up

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
