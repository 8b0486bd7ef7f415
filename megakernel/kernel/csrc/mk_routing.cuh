// Routing of one MoE layer: TOPK picks every row's experts from the router logits and lays out the layer's expert
// queue (the route record the MoE workers claim items from; mk_moe.cuh).
#pragma once
#include "mk_common.cuh"

// ---- TOPK: routing of every row of one MoE layer, and the layer's expert queue ----------------------------------
// Every step is parallel: this task is on every MoE layer's critical path (router -> top-k -> experts), and the
// serial version (one thread laying out the queue, one warp per row picking its experts one argmax at a time over
// shared memory) took ~12 us per layer. Now: a warp per row picks its k experts from registers (k rounds of a
// warp-wide max of order-preserving keys), the queue's slots and pair offsets come from ballots and a warp scan.
#define TOPK_WORDS (MK_MAX_EXPERTS / 32)

// An order-preserving key of a router logit: a larger logit has a larger key, -0 ties with +0 (as the comparison of
// a stable descending sort does), NaN sorts below -inf (key 1), key 0 marks an expert taken or absent (the plan
// checks top-k <= experts, so every round finds a key above 0).
__device__ __forceinline__ unsigned topk_key(float f) {
    if (f != f) return 1u;
    if (f == 0.f) f = 0.f;
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// One warp, one row: lane's logits raw[q] of experts q * 32 + lane (all in flight), their keys, and the row's ranks
// reset to -1. PACKED: the bf16 logit's 16-bit key above 0xffff - expert (TOPK's one-max selection; NaN keeps 1),
// else topk_key; 0 for experts past E.
template <bool PACKED>
__device__ __forceinline__ void topk_load_row(const float* logits, int E, int nq, int* rank, float* raw,
                                              unsigned* key) {
    const int lane = threadIdx.x & 31;
    // every word's load first, unconditionally (an index past E reads expert E - 1 again: in bounds, then dropped),
    // so the four L2 round trips overlap; predicated per word, each key waited for its own load before the next
    // load issued
#pragma unroll
    for (int q = 0; q < TOPK_WORDS; q++) raw[q] = ldcg_f(logits + min(q * 32 + lane, E - 1));
#pragma unroll
    for (int q = 0; q < TOPK_WORDS; q++) {
        const int e = q * 32 + lane;
        const bool in = q < nq && e < E;
        raw[q] = in ? raw[q] : 0.f;
        key[q] = !in     ? 0u
                 : PACKED ? (max(topk_key(raw[q]) >> 16, 1u) << 16) | (0xffffu - (unsigned)e)
                          : topk_key(raw[q]);
        if (q < nq) rank[e] = -1;
    }
}

// Warp 0, at most 32 pairs (B * k <= 32; the plan's topk_warp): the layer's expert queue from the rows' picks (sId,
// their routing weights in sSc, both [B][MK_MAX_TOPK]) with no block barrier, where the general layout below takes three. Lane
// i holds pair (row i / k, its kk-th pick); one bitonic sort of (expert, row, kk) keys puts the pairs in queue order
// (experts ascending, rows ascending within one), so lane j holds queue pair j: an expert's first lane (a ballot)
// writes its slot (first lanes below it), first pair (its own lane) and count (up to the next first lane), and a
// pair's rank (its expert's place among its row's experts, ascending) is the number of its row's lanes below it.
// The same queue as the general layout, element for element.
__device__ __forceinline__ void topk_queue_warp(const Params& P, int B, int k, const int* sId, const float* sSc,
                                                int* route) {
    constexpr int ld = MK_MAX_TOPK;
    const int lane = threadIdx.x & 31, n = B * k;
    unsigned key = 0xffffffffu;                                   // (past the pairs: sorts last)
    if (lane < n) {
        const int b = lane / k, kk = lane - b * k;
        key = ((unsigned)sId[b * ld + kk] << 16) | ((unsigned)b << 8) | (unsigned)kk;
    }
#pragma unroll
    for (int size = 2; size <= 32; size <<= 1) {
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            const unsigned other = __shfl_xor_sync(0xffffffffu, key, stride);
            const bool up = (lane & size) == 0 || size == 32, low = (lane & stride) == 0;
            key = (low == up) ? min(key, other) : max(key, other);
        }
    }
    const int e = (int)(key >> 16), b = (int)((key >> 8) & 0xff), kk = (int)(key & 0xff);
    const int prev = __shfl_up_sync(0xffffffffu, e, 1);
    const bool in = lane < n, first = in && (lane == 0 || prev != e);
    const unsigned firsts = __ballot_sync(0xffffffffu, first);
    const unsigned below = (1u << lane) - 1u;
    const unsigned same_row = __match_any_sync(0xffffffffu, in ? b : -1);
    if (first) {
        const unsigned later = firsts & ~(below | (1u << lane));
        const int next = later ? __ffs(later) - 1 : n;
        const int slot = __popc(firsts & below);
        route[PI(r_slot_expert) + slot] = e;
        route[PI(r_slot_start) + slot] = lane;
        route[PI(r_slot_cnt) + slot] = next - lane;
    }
    if (in) {
        route[PI(r_pair_row) + lane] = b;
        route[PI(r_pair_rank) + lane] = __popc(same_row & below);
        route[PI(r_pair_w) + lane] = __float_as_int(sSc[b * ld + kk]);
        route[PI(r_topk_ids) + b * k + kk] = e;
    }
    if (lane == 0) {
        const int na = __popc(firsts);
        route[0] = na;
        route[1] = na * (PI(gu_tiles) + PI(dn_tiles)) + PI(o_items);
    }
}

__device__ __forceinline__ void topk_phase(bool stamp, int k) {
    if (stamp) prof_phase(k);
}

// Bytes of topk_route's shared-memory scratch at the start of the dynamic shared memory (the layout below;
// plan.small_task_smem_bytes sizes it for the largest batch).
__device__ __forceinline__ int topk_scratch_bytes(int E) {
    const int nq = (E + 31) >> 5, e32 = nq * 32;
    return (MB * e32 + 2 * MB * MK_MAX_TOPK + e32 + MB * nq + 2 * nq) * 4;
}

// Where a route record copied into shared memory starts: past topk_route's scratch, 16-byte aligned (worker_topk's
// own routing, topk_warm's dry pass); it takes r_stride ints.
__device__ __forceinline__ size_t route_copy_off(const Params& P) {
    return ((size_t)topk_scratch_bytes(PI(E)) + 15) / 16 * 16;
}

// The routing of MoE layer m (every row's experts and weights, the expert queue's slots and pairs) written to
// `route`: the layer's route record in global memory (TOPK), or a copy in shared memory past the scratch (a MoE
// worker of a worker_topk plan, mk_moe.cuh). Ends without a barrier after its last writes. Not inlined into the
// persistent loop (nor is task_norm): inlined, their registers spill there. `stamp`: take TOPK's profiling marks
// (opcodes.PROF_MARKS; false where a router tile or a worker routes: their records' marks mean other things).
__device__ __noinline__ void topk_route(const Params& P, int m, int* route, bool stamp = true) {
    const int B = PI(B), Bm = PI(Bm), E = PI(E), k = PI(topk);
    const int nq = (E + 31) >> 5, e32 = nq * 32;                  // experts in whole warps' worth
    const float* rl = PP(const float*, rlog) + (size_t)m * Bm * E;
    // layout: plan.small_task_smem_bytes (route)
    int* sRank = reinterpret_cast<int*>(smem);                     // [B][e32] position in the row's top-k, or -1
    int* sId = sRank + MB * e32;                                   // [B][MAX_TOPK] the row's experts, best first
    float* sSc = reinterpret_cast<float*>(sId + MB * MK_MAX_TOPK); // [B][MAX_TOPK] their logits, then weights
    int* sStart = reinterpret_cast<int*>(sSc + MB * MK_MAX_TOPK);  // [e32] an active expert's first pair
    unsigned* sBal = reinterpret_cast<unsigned*>(sStart + e32);    // [B][nq] which experts of 32 a row chose
    int* sTot = reinterpret_cast<int*>(sBal + MB * nq);            // [2][nq] per-warp totals of the scan
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sel = PI(sel_fn), norm = PI(norm_topk);
    // 1. a warp per row: k rounds of the largest remaining key, one warp-wide max each. The router's logits are
    //    bf16 values (its epilogue rounds them; the simulator reads them as such), so the top 16 bits of their
    //    order-preserving key are the whole key, and the low 16 bits carry 0xffff - expert: one 32-bit max picks
    //    the largest logit, ties going to the smaller expert, with no ballot per word. Then the routing weights,
    //    a lane per chosen expert, summed in the order the reference sums them.
    for (int b = warp; b < B; b += NW) {
        float raw[TOPK_WORDS];
        unsigned key[TOPK_WORDS];
        topk_load_row<true>(rl + (size_t)b * E, E, nq, sRank + b * e32, raw, key);
        __syncwarp();                           // every lane's -1 before lane 0 writes the picks' ranks
        float mine = 0.f;                       // lane kk: the logit of the row's kk-th expert
        for (int kk = 0; kk < k; kk++) {
            unsigned mx = 0u;
#pragma unroll
            for (int q = 0; q < TOPK_WORDS; q++) mx = max(mx, key[q]);
            mx = __reduce_max_sync(0xffffffffu, mx);
            if (kk == 0) topk_phase(stamp, 0);  // (the first max needs every lane's logits: they have landed)
            const int pick = 0xffff - (int)(mx & 0xffffu), pq = pick >> 5;
            const bool owner = lane == (pick & 31);
            float v = 0.f;
#pragma unroll
            for (int q = 0; q < TOPK_WORDS; q++) {
                v = q == pq ? raw[q] : v;
                key[q] = (q == pq && owner) ? 0u : key[q];
            }
            v = __shfl_sync(0xffffffffu, v, pick & 31);
            if (lane == kk) mine = v;
            if (lane == 0) {
                sId[b * MK_MAX_TOPK + kk] = pick;
                sRank[b * e32 + pick] = kk;
            }
        }
        const bool own = lane < k;
        float wgt;
        if (sel == MK_SEL_SOFTMAX) {
            const float mxv = warp_max(own ? mine : -INFINITY);
            const float ex = own ? expf(mine - mxv) : 0.f;
            float sum = 0.f;
            for (int kk = 0; kk < k; kk++) sum += __shfl_sync(0xffffffffu, ex, kk);
            wgt = rbf(ex / sum);
        } else {
            wgt = own ? rbf(1.f / (1.f + expf(-mine))) : 0.f;
            if (norm) {
                float sum = 0.f;
                for (int kk = 0; kk < k; kk++) sum += __shfl_sync(0xffffffffu, wgt, kk);
                wgt = rbf(wgt / rbf(sum));
            }
        }
        if (own) sSc[b * MK_MAX_TOPK + lane] = wgt;
    }
    __syncthreads();
    topk_phase(stamp, 1);
    // slot_pairs: an expert's pairs in queue slots of at most R (several slots for an expert of more pairs); with
    // R >= B no expert has more (a row picks an expert once), and the warp layout's one slot per expert holds
    const int R = PI(slot_pairs) > 0 ? PI(slot_pairs) : B;
    if (PI(topk_warp) && B * k <= 32 && R >= B) {   // every pair in one warp's lanes: no further block barrier
        if (warp == 0) topk_queue_warp(P, B, k, sId, sSc, route);
        topk_phase(stamp, 2);
#if MK_PROFILE
        __syncthreads();
#endif
        topk_phase(stamp, 3);
        return;
    }
    // 2. per expert (a thread each, whole warps): the rows that chose it, then its slot (active experts ascending)
    //    and its first pair (counts summed in that order) by a scan over the experts
    int cnt = 0, act_incl = 0, cnt_incl = 0;
    if (threadIdx.x < e32) {
        const int e = threadIdx.x;
        for (int b = 0; b < B; b++) {
            const bool c = sRank[b * e32 + e] >= 0;
            const unsigned bal = __ballot_sync(0xffffffffu, c);
            if (lane == 0) sBal[b * nq + warp] = bal;
            cnt += c;
        }
        act_incl = (cnt + R - 1) / R;           // the expert's queue slots
        cnt_incl = cnt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int a2 = __shfl_up_sync(0xffffffffu, act_incl, o), c2 = __shfl_up_sync(0xffffffffu, cnt_incl, o);
            if (lane >= o) { act_incl += a2; cnt_incl += c2; }
        }
        if (lane == 31) { sTot[warp] = act_incl; sTot[nq + warp] = cnt_incl; }
    }
    __syncthreads();
    if (threadIdx.x < e32) {
        int a_off = 0, c_off = 0;
        for (int w = 0; w < warp; w++) { a_off += sTot[w]; c_off += sTot[nq + w]; }
        if (cnt) {
            const int ns = (cnt + R - 1) / R, slot0 = a_off + act_incl - ns, start = c_off + cnt_incl - cnt;
            for (int s = 0; s < ns; s++) {       // (consecutive slots, consecutive pairs: rows ascending)
                route[PI(r_slot_expert) + slot0 + s] = threadIdx.x;
                route[PI(r_slot_start) + slot0 + s] = start + s * R;
                route[PI(r_slot_cnt) + slot0 + s] = min(R, cnt - s * R);
            }
            sStart[threadIdx.x] = start;
        }
        if (threadIdx.x == 0) {
            int na = 0;
            for (int w = 0; w < nq; w++) na += sTot[w];
            route[0] = na;
            route[1] = na * (PI(gu_tiles) + PI(dn_tiles)) + PI(o_items);
        }
    }
    __syncthreads();
    topk_phase(stamp, 2);
    // 3. the pairs, grouped by expert (ascending), rows ascending within an expert; rank: the expert's position
    //    among the row's experts in ascending order (where the down item writes its share of y)
    for (int i = threadIdx.x; i < B * k; i += NT) {
        const int b = i / k, kk = i - b * k;
        const int e = sId[b * MK_MAX_TOPK + kk], w = e >> 5;
        const unsigned bit = 1u << (e & 31);
        int before = 0;                                   // earlier rows that chose e
        for (int b2 = 0; b2 < b; b2++) before += (sBal[b2 * nq + w] & bit) != 0;
        int rank = __popc(sBal[b * nq + w] & (bit - 1));  // this row's experts below e
        for (int w2 = 0; w2 < w; w2++) rank += __popc(sBal[b * nq + w2]);
        const int pi = sStart[e] + before;
        route[PI(r_pair_row) + pi] = b;
        route[PI(r_pair_rank) + pi] = rank;
        route[PI(r_pair_w) + pi] = __float_as_int(sSc[b * MK_MAX_TOPK + kk]);
        route[PI(r_topk_ids) + b * k + kk] = e;
    }
#if MK_PROFILE
    __syncthreads();                         // (profiling only: every pair written, for the mark)
#endif
    topk_phase(stamp, 3);
}

// MK_PG_TLB_WARM (mk_pg_switches.cuh: why): one line of every 2 MB region of n routed experts' gate/up ([2I, H]) and
// down ([H, I]) weights of a layer, and each span's last line (a span need not start on a region's boundary), into
// L2 by threads tid, tid + nthr, ... (expert(i): the i-th expert; mode 2: by the load path, prefetch.global.L2; else
// by the copy engine, cp.async.bulk.prefetch), so each region's address translation is done before its copies.
template <class Expert>
__device__ __forceinline__ void warm_expert_regions(const Params& P, const bf16* egu, const bf16* edn, int n,
                                                    Expert&& expert, int tid, int nthr, int mode,
                                                    unsigned long long pol) {
    constexpr size_t REGION = 2u << 20;
    const size_t gu_bytes = (size_t)2 * PI(I) * PI(H) * 2, dn_bytes = (size_t)PI(H) * PI(I) * 2;
    const int per_gu = (int)((gu_bytes + REGION - 1) / REGION) + 1;
    const int per = per_gu + (int)((dn_bytes + REGION - 1) / REGION) + 1;
    for (int i = tid; i < n * per; i += nthr) {
        const int x = i / per, k = i - x * per, e = expert(x);
        const bool gu = k < per_gu;
        const char* base = gu ? reinterpret_cast<const char*>(egu + (size_t)e * 2 * PI(I) * PI(H))
                              : reinterpret_cast<const char*>(edn + (size_t)e * PI(H) * PI(I));
        const size_t len = gu ? gu_bytes : dn_bytes;
        const char* a = base + (min((size_t)(gu ? k : k - per_gu) * REGION, len - 16) & ~(size_t)15);
        if (mode == 2) asm volatile("prefetch.global.L2 [%0];" ::"l"(a) : "memory");
        else l2_prefetch_bulk(a, 16, pol);
    }
}

#if MK_PG_TLB_WARM == 3
// (MK_PG_TLB_WARM=3) All threads of the block that routed layer l (route: its record, written and ordered by the
// signal's block barrier), after its signal: the routed experts' regions warmed (warm_expert_regions, by the copy
// engine), ~3 us before the workers' first copies where the workers' own warm-up (1, 2) comes only with them.
__device__ __noinline__ void topk_warm_regions(const Params& P, int l, const int* route) {
    const long long* wp = layer_wptr(P, l);
    const bf16* egu = reinterpret_cast<const bf16*>(wp[WP_E_GU]);
    const bf16* edn = reinterpret_cast<const bf16*>(wp[WP_E_DOWN]);
    const int n = ldcg_i(route), off = PI(r_slot_expert);
    warm_expert_regions(P, egu, edn, n, [&](int x) { return ldcg_i(route + off + x); }, threadIdx.x, NT, 1,
                        l2_evict_first());
}
#endif

__device__ __forceinline__ int atom_add_acq_rel(int* p, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// All threads, at the end of a router tile of a router_topk plan (rec: a2 the layer's top-k counter, a3 its router
// tiles; schedule.py): the tile's add to the router counter is an acq_rel atomic, and the tile whose add completes
// the count (every other tile released its logits before its own add; this add acquired them) routes layer m
// (topk_route) and signals the top-k counter. Replaces task_signal for the tile. False on a layout error.
__device__ __noinline__ bool router_signal_route(const Params& P, const int* rec, int ticket, int m) {
    __shared__ int s_last;
    __syncthreads();                          // every logit of this tile stored
    prof_mark(PS_END);
    if (threadIdx.x == 0) {
        s_last = atom_add_acq_rel(PP(int*, counters) + rec[RF_SIG], 1) == rec[RF_A3] - 1;
    }
    __syncthreads();
    if (s_last) {
        if (!smem_fits(P, (size_t)topk_scratch_bytes(PI(E)), ticket)) return false;
        topk_route(P, m, PP(int*, route) + (size_t)m * PI(r_stride), false);
        task_signal(P, rec[RF_A2]);
#if MK_PG_TLB_WARM == 3
        topk_warm_regions(P, rec[RF_LAYER], PP(const int*, route) + (size_t)m * PI(r_stride));
#endif
    } else {
        claim_after_signal(P);
    }
    return true;
}

__device__ __noinline__ bool task_topk(const Params& P, const int* rec, int ticket) {
    const int m = rec[RF_A0];
    // topk_warm: a dry pass over the previous MoE layer's logits (final long before) into a route copy in shared
    // memory while the router tiles run: TOPK lands on a different SM every layer, and the b1 trace put its first,
    // cold pass at ~5 us after its wait against ~2.9 for a second, warm one (MK_REPEAT_SMALL=2). Nothing global is
    // written; wait_rec's barrier orders the dry pass's shared memory before the real one.
    const size_t dry = route_copy_off(P);
    if (PI(topk_warm) && m > 0 && dry + (size_t)PI(r_stride) * 4 <= dynamic_smem_bytes())
        topk_route(P, m - 1, reinterpret_cast<int*>(smem + dry), false);
    if (!wait_rec(P, rec, ticket)) return false;
    int* route = PP(int*, route) + (size_t)m * PI(r_stride);
    for (int rep = 0; rep < MK_REPEAT_SMALL; rep++) {   // (the same route written again: nobody reads it yet)
        if (rep) __syncthreads();
        topk_route(P, m, route);
    }
    task_signal(P, rec[RF_SIG]);
#if MK_PG_TLB_WARM == 3
    topk_warm_regions(P, rec[RF_LAYER], route);
#endif
    return true;
}
