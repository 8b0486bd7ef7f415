// Routed experts: MOE_WORKER claims the gate/up and down items of its layer's expert queue (laid out by TOPK,
// mk_routing.cuh) until it is empty.
#pragma once
#include "mk_common.cuh"
#include "mk_gemv.cuh"      // the experts' tiles run on the GEMV core
#include "mk_routing.cuh"   // (worker_topk plans: each worker routes its layer itself)

// MK_GU_ONE_REGION_PROBE (a speed probe, 0; 1 computes wrong outputs and build.load refuses it without
// $MEGAKERNEL_SPEED_PROBE=1): each gate/up item reads its gate and up rows as one contiguous region (moe_item).
#ifndef MK_GU_ONE_REGION_PROBE
#define MK_GU_ONE_REGION_PROBE 0
#endif

// ---- MOE_WORKER: claims expert work items of one layer until the queue is empty --------------------------------
// One work item: a gate/up tile (with SiLU * up) or a down tile of one active expert slot, or (o_queue) a tile of
// the layer's O projection (slot -1).
#if MK_MOE_LOCAL
// The layer's routing as the plain MoE worker keeps it (route_to_shared): every slot's expert | first pair << 9 |
// count << 18, every pair's row; a down item's pairs' weights and ranks.
__shared__ int s_route_slot[MK_MAX_SLOTS];
__shared__ unsigned char s_route_row[MK_MAX_PAIRS];
__shared__ float s_pair_w[MB];
__shared__ int s_pair_rank[MB];

// Every pair's routing weight (bf16 bits: topk_route rounds the weights to bf16) and rank, which a down item's
// epilogue takes from here: read with the rest of the route at the worker's start, not from the route record after
// the down item's wait for its gate/up counter (an L2 round trip in front of its activation rows' copies).
__shared__ unsigned short s_route_pw[MK_MAX_PAIRS];
__shared__ unsigned char s_route_rank[MK_MAX_PAIRS];

// All threads (before a barrier): the route's slots and pairs into shared memory; only the first n_active slots and
// B * topk pairs hold this step's routing (the rest are never read). OWN: `route` is this worker's own copy in
// shared memory (worker_topk), read directly; else the layer's record in global memory, read from L2. A thread's
// loads of slot i and pair i are issued together before its stores (one L2 round trip per pass: with separate slot
// and pair loops, the pair loads issued only after the slot stores, two round trips in a row on every MoE layer's
// path to its first expert item).
template <bool OWN = false>
__device__ __forceinline__ void route_to_shared(const Params& P, const int* route) {
    auto at = [&](int i) { return OWN ? route[i] : ldcg_i(route + i); };
    const int ns = PI(n_slots), np = PI(n_pairs);
    for (int i = threadIdx.x; i < max(ns, np); i += NT) {
        const bool slot = i < ns, pair = i < np;
        const int e = slot ? at(PI(r_slot_expert) + i) : 0, st = slot ? at(PI(r_slot_start) + i) : 0;
        const int cnt = slot ? at(PI(r_slot_cnt) + i) : 0, row = pair ? at(PI(r_pair_row) + i) : 0;
        const int rank = pair ? at(PI(r_pair_rank) + i) : 0, w = pair ? at(PI(r_pair_w) + i) : 0;
        if (slot) s_route_slot[i] = e | (st << 9) | (cnt << 18);
        if (pair) {
            s_route_row[i] = (unsigned char)row;
            s_route_rank[i] = (unsigned char)rank;
            s_route_pw[i] = (unsigned short)((unsigned)w >> 16);   // (float bits: bf16 exact)
        }
    }
}

// worker_topk plans, all threads: this worker routes layer m itself (topk_route, into a copy of the route record in
// the dynamic shared memory, which no item uses yet), then keeps what its items need as route_to_shared does, and
// the header in hdr[0..1]. The worker that claimed item 0 (hdr[2], thread 0's claim) writes the record to global
// memory for the host (routed-expert counts); nothing in the kernel reads it. Ends on a barrier.
__device__ __forceinline__ bool route_in_worker(const Params& P, int m, int* route_g, int* hdr, int ticket) {
    const size_t off = route_copy_off(P);
    if (!smem_fits(P, off + (size_t)PI(r_stride) * 4, ticket)) return false;
    int* sr = reinterpret_cast<int*>(smem + off);
    if (threadIdx.x == 0) hdr[2] = atomicAdd(PP(int*, moe_work) + m, 1);   // (its round trip under the routing)
    topk_route(P, m, sr, false);
    __syncthreads();
    route_to_shared<true>(P, sr);
    if (threadIdx.x == 0) { hdr[0] = sr[0]; hdr[1] = sr[1]; }
    __syncthreads();
    if (hdr[2] == 0)
        for (int i = threadIdx.x; i < PI(r_stride); i += NT) route_g[i] = sr[i];
    __syncthreads();                          // (the record copy read before an item's tile lands over it)
    return true;
}
#endif

// The first O item of a layer's queue (o_queue plans): after its n_gu gate/up items and the first o_after eighths of
// its down items (plan.ModelPlan.o_after; the simulator's _o_start is the same formula).
__device__ __forceinline__ int o_queue_start(const Params& P, int n_gu) {
    return n_gu + ((n_gu / PI(gu_tiles)) * PI(dn_tiles) * PI(o_after) >> 3);
}

// Item `item` of a queue without O items (n_s expert slots, G gate/up and D down items each): its slot and tile,
// and whether it is a down item. lag 0: every gate/up item, then every down item; lag > 0: the down items of slot
// s right after the gate/up items of slot s + lag (the last lag slots' after every gate/up item), so a down item's
// gate/up items are always earlier in the queue (plan.ModelPlan.dn_lag; simulator.queue_kind is the same). The lag
// is at most half the step's slots (a lag past them would put every down item last: b4, ~30 slots, under
// dn_lag=32), and 0 under MK_DN_LAG_MIN (a short lag makes down items wait on gate/up items still loading).
__device__ __forceinline__ bool queue_kind(int n_s, int G, int D, int lag, int item, int& slot, int& t) {
    int base = 0, s0 = 0;
    lag = min(lag, n_s >> 1);
    if (lag < MK_DN_LAG_MIN) lag = 0;
    if (lag > 0 && lag < n_s) {
        const int head = lag * G, mid = (n_s - lag) * (G + D);
        if (item < head) { slot = item / G; t = item - slot * G; return false; }
        if (item < head + mid) {
            const int k = (item - head) / (G + D), r = (item - head) - k * (G + D);
            if (r < G) { slot = k + lag; t = r; return false; }
            slot = k; t = r - G; return true;
        }
        base = head + mid; s0 = n_s - lag;          // the last lag slots' down items
    } else {
        if (item < n_s * G) { slot = item / G; t = item - slot * G; return false; }
        base = n_s * G;
    }
    const int j = item - base;
    slot = s0 + j / D; t = j - (j / D) * D;
    return true;
}

struct MoeItem {
    bool down;
    int slot, e, st, cnt, r0, nr;
    Tile T;
};

// (ow: the layer's O-projection weights where the caller has their address, MK_EARLY_TABLES; else the layer table's)
__device__ __forceinline__ MoeItem moe_item(const Params& P, int l, const int* route, const bf16* egu,
                                            const bf16* edn, int item, int n_gu, const bf16* ow = nullptr) {
    const int H = PI(H), I = PI(I), gu_tiles = PI(gu_tiles), gu_rows = PI(gu_rows), dn_rows = PI(dn_rows);
    const int n_o = PI(o_items);
    // the O items start after the gate/up items and o_after eighths of the down items (o_queue_start)
    const int o0 = n_o ? o_queue_start(P, n_gu) : 0;
    MoeItem it;
    if (n_o && item >= o0 && item < o0 + n_o) {
        it.down = false;
        it.slot = -1; it.e = -1; it.st = 0; it.cnt = PI(B);
        it.r0 = (item - o0) * PI(o_rows); it.nr = min(PI(o_rows), H - it.r0);
        // (with ow: static_tile's O tile without its table read)
        it.T = ow != nullptr ? oproj_tile(P, ow, it.r0, it.nr) : static_tile(P, OP_OPROJ, l, it.r0, it.nr);
        return it;
    }
    if (n_o && item >= o0) item -= n_o;       // (the plan's dn_lag is 0 where O items are queued)
    int t;
    it.down = queue_kind(n_gu / gu_tiles, gu_tiles, PI(dn_tiles), PI(dn_lag), item, it.slot, t);
#if MK_MOE_LOCAL
    const int packed = s_route_slot[it.slot];
    it.e = packed & 511; it.st = (packed >> 9) & 511; it.cnt = packed >> 18;
#else
    it.e = ldcg_i(route + PI(r_slot_expert) + it.slot);
    it.st = ldcg_i(route + PI(r_slot_start) + it.slot);
    it.cnt = ldcg_i(route + PI(r_slot_cnt) + it.slot);
#endif
    if (!it.down) {
        it.r0 = t * gu_rows; it.nr = min(gu_rows, I - it.r0);
        it.T.K = H; it.T.n0 = it.nr; it.T.n1 = it.nr;
#if MK_GU_ONE_REGION_PROBE
        // A speed probe, numerically wrong: the item's gate and up rows read as one contiguous region (where a
        // layout interleaving gate and up in item-sized chunks would put them) instead of two halves I rows apart:
        // what one region per item instead of two would buy the step (session 44; the switch is described above).
        it.T.w0 = egu + ((size_t)it.e * 2 * I + 2 * it.r0) * H;
        it.T.w1 = it.T.w0 + (size_t)it.nr * H;
#else
        it.T.w0 = egu + ((size_t)it.e * 2 * I + it.r0) * H;
        it.T.w1 = egu + ((size_t)it.e * 2 * I + I + it.r0) * H;
#endif
    } else {
        it.r0 = t * dn_rows; it.nr = min(dn_rows, H - it.r0);
        it.T.K = I; it.T.n0 = it.nr; it.T.n1 = 0; it.T.w1 = nullptr;
        it.T.w0 = edn + ((size_t)it.e * H + it.r0) * I;
    }
    return it;
}

// Input row i of an item: a down item's gate/up activations (its pairs), a gate/up item's routed row of x.
__device__ __forceinline__ const bf16* item_xrow(const Params& P, int l, int m, const int* route, bool down, int st,
                                                 int i) {
#if MK_MOE_LOCAL
    const int row = s_route_row[st + i];
#else
    const int row = down ? 0 : ldcg_i(route + PI(r_pair_row) + st + i);
#endif
    return down ? PP(const bf16*, eact) + ((size_t)m * PI(n_pairs) + st + i) * PI(I)
                : PP(const bf16*, x) + ((size_t)l * PI(Bm) + row) * PI(H);
}

// A gate/up item's epilogue: SiLU(gate) * up of its rows (sOut) into eact. Threads 0..NTHREADS-1.
template <int NTHREADS>
__device__ __forceinline__ void gu_epilogue(const Params& P, int m, int st, int cnt, int r0, int nr) {
    const int I = PI(I);
    const float* sOut = reinterpret_cast<const float*>(smem + SM_OUT);
    bf16* out = PP(bf16*, eact) + ((size_t)m * PI(n_pairs) + st) * I;
    for (int i = threadIdx.x; i < nr * cnt; i += NTHREADS) {
        const int r = i / cnt, b = i - r * cnt;
        const float g = rbf(sOut[r * MB + b]), u = rbf(sOut[(nr + r) * MB + b]);
        out[(size_t)b * I + r0 + r] = f2bf(rbf(g / (1.f + expf(-g))) * u);
    }
}

// A down item's epilogue: its rows (sOut) times each pair's routing weight into y. Threads 0..NTHREADS-1. LOCAL:
// the pairs' weights, rows and ranks from shared memory (MK_MOE_LOCAL's plain worker loaded them).
template <int NTHREADS, bool LOCAL = false>
__device__ __forceinline__ void down_epilogue(const Params& P, int m, const int* route, int st, int cnt, int r0,
                                              int nr) {
    const int H = PI(H), topk = PI(topk);
    const float* sOut = reinterpret_cast<const float*>(smem + SM_OUT);
    bf16* y = PP(bf16*, y) + (size_t)m * PI(Bm) * topk * H;
    for (int i = threadIdx.x; i < nr * cnt; i += NTHREADS) {
        const int r = i / cnt, b = i - r * cnt;
        const int pi = st + b;
        float w;
        int row, rank;
#if MK_MOE_LOCAL
        if (LOCAL) {
            w = s_pair_w[b]; row = s_route_row[pi]; rank = s_pair_rank[b];
        } else
#endif
        {
            w = __int_as_float(ldcg_i(route + PI(r_pair_w) + pi));
            row = ldcg_i(route + PI(r_pair_row) + pi); rank = ldcg_i(route + PI(r_pair_rank) + pi);
        }
        y[((size_t)row * topk + rank) * H + r0 + r] = f2bf(rbf(sOut[r * MB + b]) * w);
    }
}

// The profiling record of MoE work item `item` of layer l (MoE layer m).
__device__ __forceinline__ void prof_item(const Params& P, int m, int item, int op, int l, long long arg) {
    prof_record(PP(long long*, prof_items) + ((size_t)m * PI(prof_items_per_layer) + item) * MK_PROF_INTS, op, l, arg);
}

// The input rows sX holds between a worker's items (the ring layout, either layout with MK_MOE_LOCAL): their
// addresses, inner size and where sX sits; count 0: none (reset when a worker starts: other task kinds wrote there).
// Consecutive items with the same inputs load them once: every gate/up item of a batch-1 step reads row 0 of x, an
// expert's down items its pairs' activations (complete once its gate/up items are, which each one waited for).
__shared__ const bf16* s_xprev[MB];
__shared__ int s_xprev_n, s_xprev_k;
__shared__ size_t s_xprev_off;

// Every thread, after the barrier that published s_xrow: sX at `off` already holds those cnt rows of K elements.
__device__ __forceinline__ bool inputs_held(int cnt, int K, size_t off) {
    bool same = s_xprev_n == cnt && s_xprev_k == K && s_xprev_off == off;
    for (int i = 0; same && i < cnt; i++) same = s_xrow[i] == s_xprev[i];
    return same;
}

// After a barrier that every thread passed once it asked inputs_held: sX holds the rows of s_xrow now.
__device__ __forceinline__ void inputs_hold(int cnt, int K, size_t off) {
    if (threadIdx.x < cnt) s_xprev[threadIdx.x] = s_xrow[threadIdx.x];
    if (threadIdx.x == 0) { s_xprev_n = cnt; s_xprev_k = K; s_xprev_off = off; }
}

#if MK_PROFILE
// The worker task's own stamps (its items have theirs): claimed and waited for the routing, then ended.
__device__ __forceinline__ void prof_worker_stamps(long long claim, long long waited) {
    if (threadIdx.x == 0) {
        s_prof[PS_CLAIM] = claim;
        s_prof[PS_ISSUED] = s_prof[PS_WAITED] = s_prof[PS_LANDED] = waited;
        s_prof[PS_COMPUTED] = -1;           // the worker task itself: its end
    }
}
#endif

// The epilogue of a plain worker's item (its rows out of sOut), on warps 0..NWC-1: an O item's outputs, a gate/up
// item's activations and its expert's gate/up counter, a down item's weighted rows; each ends on a barrier of
// those warps (the signal's, or under MK_PROFILE the end stamp's; a down or O item without profiling on none: the
// next item's first barrier orders its writes before anything reuses sOut).
template <int NWC>
__device__ __forceinline__ void item_epilogue(const Params& P, int l, int m, const int* route, const MoeItem& it,
                                              int item, int gu_ctr) {
    if (it.slot < 0) {
        oproj_epilogue<NWC * 32>(P, l, it.r0, it.nr);
#if MK_PROFILE
        group_sync<NWC>();
        prof_mark(PS_END);
        prof_item(P, m, item, MK_PROF_ITEM_O, l, item);
#endif
    } else if (!it.down) {
        gu_epilogue<NWC * 32>(P, m, it.st, it.cnt, it.r0, it.nr);
        group_signal<NWC>(P, gu_ctr);
        prof_item(P, m, item, MK_PROF_ITEM_GU, l, ((long long)it.e << 16) | item);
    } else {
        down_epilogue<NWC * 32, MK_MOE_LOCAL != 0>(P, m, route, it.st, it.cnt, it.r0, it.nr);
#if MK_PROFILE
        group_sync<NWC>();
        prof_mark(PS_END);
        prof_item(P, m, item, MK_PROF_ITEM_DN, l, ((long long)it.e << 16) | item);
#endif
    }
}

// An expert item's tile into buffer `buf`: of the expert ring (moe_w) or of the prefetching layout (sm_w). All
// threads call it; warp 0 issues.
__device__ __forceinline__ void issue_item(const Params& P, const Tile& T, int buf, bool ring) {
    if (threadIdx.x < 32)
        issue_weights_w0(reinterpret_cast<bf16*>(smem + (ring ? moe_w(P, buf) : sm_w(P, buf))), T.w0, T.n0, T.w1,
                         T.n1, T.K, buf);
}

#if MK_MOE_LOCAL
#include "mk_moe_pages.cuh"   // the paged worker (moe_pages plans): the same items on a ring of pages
#endif

// With two weight buffers the worker claims one item ahead and issues its tile before computing the current one;
// the claim after the last item prefetches the block's next ticket instead. Claiming ahead keeps the induction of
// schedule.py: items run in claim order, every gate/up item precedes every down item, so a worker never holds a
// gate/up item behind the down item it is waiting on.
__device__ bool task_moe_worker(const Params& P, const int* rec, int ticket) {
    // worker_claim_early: thread 0's first claim goes out before the wait for the routing (the claim is a counter, not
    // data: the item's dependencies are all met after the routing, so the ticket induction holds; schedule.py), its
    // result kept in a register across the wait and read with the route's loads
    const bool claim_early = PI(worker_claim_early) && !PI(worker_topk);
    int early_first = 0;
    if (claim_early && threadIdx.x == 0) early_first = atomicAdd(PP(int*, moe_work) + rec[RF_A0], 1);
#if MK_MOE_LOCAL
    if (PI(pg_n) && PI(pg_early) && !PI(worker_topk)) {   // the paged worker's set-up under the wait for the routing
        if (!smem_fits(P, (size_t)PI(pg_state_off) + sizeof(PgState), ticket)) return false;
        pg_setup(P);                          // (wait_rec's block barrier publishes it)
    }
#endif
    if (!wait_rec(P, rec, ticket)) return false;
#if MK_PROFILE
    const long long task_claim = s_prof[PS_CLAIM], task_waited = s_prof[PS_WAITED];   // thread 0's copies
#endif
    const int l = rec[RF_LAYER], m = rec[RF_A0];
    const int* route = PP(const int*, route) + (size_t)m * PI(r_stride);
    const long long* wp = layer_wptr(P, l);
    const bf16* egu = reinterpret_cast<const bf16*>(wp[WP_E_GU]);
    const bf16* edn = reinterpret_cast<const bf16*>(wp[WP_E_DOWN]);
#if MK_EARLY_TABLES
    // the O items' weights and bias too, here: their loads go out with the experts' and the route's
    const bf16* ow = reinterpret_cast<const bf16*>(wp[WP_O]);
    const bf16* obias = reinterpret_cast<const bf16*>(wp[WP_O_BIAS]);
#else
    const bf16* ow = nullptr;
#endif
    // two weight buffers: the prefetching layout's (shared with the static tasks) or the expert ring (moe_ring
    // plans: the plain worker double-buffers its items in it, the inputs after both buffers)
    const bool ring = PI(moe_wbuf) != 0 && PI(wbuf) == 0;
    const bool two = PI(wbuf) != 0 || ring;
    __shared__ int s_w[4];
    const bool keep_x = ring || MK_MOE_LOCAL;   // sX kept between items (inputs_held)
    if (threadIdx.x == 0) s_xprev_n = 0;
    const bool wtopk = PI(worker_topk) != 0;  // this worker routes the layer itself (it waited on the router tiles)
#if MK_MOE_LOCAL
    if (wtopk) {
        if (!route_in_worker(P, m, PP(int*, route) + (size_t)m * PI(r_stride), s_w, ticket)) return false;
    } else
#else
    if (wtopk) {                              // (the plan's knob needs the build's MK_MOE_LOCAL=1)
        if (threadIdx.x == 0) record_error(P, MK_ERR_BAD_OPCODE, ticket);
        return false;
    }
#endif
    {
        // thread 0's header loads and first claim go out with every thread's route loads, and land in shared
        // memory after them: one L2 round trip (stored first, the route's loads waited for the header's)
        int n_act = 0, n_it = 0, first = 0;
        if (threadIdx.x == 0) {
            n_act = ldcg_i(route);
            n_it = ldcg_i(route + 1);
            first = claim_early ? early_first : atomicAdd(PP(int*, moe_work) + m, 1);
        }
#if MK_MOE_LOCAL
        route_to_shared(P, route);
#endif
        if (threadIdx.x == 0) { s_w[0] = n_act; s_w[1] = n_it; s_w[2] = first; }
        __syncthreads();
    }
    const int n_active = s_w[0], n_items = s_w[1];
    const int n_gu = n_active * PI(gu_tiles);
    int* work = PP(int*, moe_work) + m;
#if MK_MOE_LOCAL
    // the plan's paged layout: its item slots hold pg_rows rows, every item's count is at most that (pg_rows is the
    // plan's tile_batch, or slot_pairs, which TOPK's slots then never exceed), so any launch of the plan runs paged
    // (B > pg_rows with slot_pairs: the plain worker would run the paged layout's 256 KB items, ERR_SMEM)
    if (PI(pg_n)) {
#if !MK_EARLY_TABLES
        const bf16* obias = reinterpret_cast<const bf16*>(wp[WP_O_BIAS]);
#endif
        if (!moe_worker_pages(P, ticket, l, m, route, egu, edn, obias, ow, n_gu, n_items, s_w[2]))
            return false;
#if MK_PROFILE
        prof_worker_stamps(task_claim, task_waited);
#endif
        task_signal(P, rec[RF_SIG]);
        return true;
    }
#endif
    int item = s_w[2], buf = 0;
    bool issued = false;                     // the current item's tile is in flight in `buf`
    // moe_claim_late (one buffer): thread 0 keeps the next claim's answer in a register until this item's GEMV is
    // done, then publishes it in s_w[2] before the item's last barrier
    const bool late = !two && PI(moe_claim_late);
    if (item >= n_items) prefetch_next(P, 1);
    while (item < n_items) {
        prof_reset();
        const MoeItem it = moe_item(P, l, route, egu, edn, item, n_gu);
        const int R = it.T.n0 + it.T.n1;
        const size_t x_off = ring ? moe_x(P) : sm_x(P, R, it.T.K);
        if (!smem_fits(P, x_off + (size_t)it.cnt * row_pitch(it.T.K) * 2, ticket) ||
            (ring && (size_t)R * row_pitch(it.T.K) * 2 > (size_t)PI(moe_wbuf))) {
            drain_weights();
            return false;
        }
        if (!issued) { issue_item(P, it.T, buf, ring); prof_mark(PS_ISSUED); }
        int claim = 0;                       // (late: thread 0's answer, published after the GEMV)
        if (late) {
            if (threadIdx.x == 0) claim = atomicAdd(work, 1);
        } else {
            __syncthreads();                 // s_w[2] of the previous claim has been read by every thread
            if (threadIdx.x == 0) s_w[2] = atomicAdd(work, 1);
            __syncthreads();
        }
        prof_phase(0);
        const int nxt = late ? 0 : s_w[2];
        bool prefetched = false;             // the next item's tile is in flight in buf ^ 1
        if (two) {
            if (nxt < n_items) {
                issue_item(P, moe_item(P, l, route, egu, edn, nxt, n_gu).T, buf ^ 1, ring);
                prefetched = true;
            } else {
                prefetch_next(P, buf ^ 1);
            }
        }
        prof_phase(1);
        const bool oitem = it.slot < 0;
        const int gu_ctr = l * PI(cpl) + PI(c_gu) + it.slot;
        if (it.down && !block_wait(P, gu_ctr, PI(gu_tiles), ticket)) { drain_weights(); return false; }
        if (oitem && !block_wait(P, l * PI(cpl) + PI(c_comb), PI(B) * PI(n_kv) * PI(combine_parts), ticket)) {
            drain_weights();
            return false;
        }
        prof_mark(PS_WAITED);
        if (threadIdx.x < it.cnt) {
            const int i = threadIdx.x;
            s_xrow[i] = oitem ? PP(const bf16*, attn) + ((size_t)l * PI(Bm) + i) * PI(q_dim)
                              : item_xrow(P, l, m, route, it.down, it.st, i);
        }
        __syncthreads();
        const bool same = keep_x && inputs_held(it.cnt, it.T.K, x_off);
#if MK_MOE_LOCAL
        if (it.down && threadIdx.x < it.cnt) {   // the epilogue's pair weights and ranks (route_to_shared's)
            s_pair_w[threadIdx.x] = __uint_as_float((unsigned)s_route_pw[it.st + threadIdx.x] << 16);
            s_pair_rank[threadIdx.x] = s_route_rank[it.st + threadIdx.x];
        }
#endif
        if (!same) load_x(reinterpret_cast<bf16*>(smem + x_off), it.cnt, it.T.K);
#if MK_PROFILE
        __syncthreads();                     // (profiling only: the inputs' loads are done, for the mark)
        prof_phase(2);
#endif
        wait_weights(buf);                   // (its barrier: every thread compared s_xprev, sX is published)
        if (keep_x) inputs_hold(it.cnt, it.T.K, x_off);
        if (ring) {
            gemv_at(reinterpret_cast<const bf16*>(smem + moe_w(P, buf)), reinterpret_cast<const bf16*>(smem + x_off),
                    R, it.T.K, it.cnt);
            prof_mark(PS_COMPUTED);
        } else {
            gemv(P, buf, R, it.T.K, it.cnt);
        }
        // late: every thread read the previous answer at the end of the last item, and the GEMV's barriers since
        // then separate that read from this write; the item's last barrier below publishes it
        if (late && threadIdx.x == 0) s_w[2] = claim;
        item_epilogue<NW>(P, l, m, route, it, item, gu_ctr);
        if (late) {
            if (oitem || it.down) __syncthreads();   // (a gate/up item's signal ended on one)
            item = s_w[2];
        } else {
            item = nxt;
        }
        issued = prefetched;
        if (prefetched) buf ^= 1;
    }
#if MK_PROFILE
    prof_worker_stamps(task_claim, task_waited);
#endif
    task_signal(P, rec[RF_SIG]);
    return true;
}
