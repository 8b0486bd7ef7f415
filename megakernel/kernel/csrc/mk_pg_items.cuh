// The paged MoE worker's per-item work: a page's product (the computing warps), an item's input rows (the input
// warp), its epilogue and slot release (the warp that counts its last page), and the worker's set-up. Read through
// mk_moe_pages.cuh, which mk_moe.cuh includes after the routing arrays (s_route_row) these read.
#pragma once
#include "mk_common.cuh"
#include "mk_loader.cuh"
#include "mk_gemv_core.cuh"
#include "mk_page_math.cuh"
#include "mk_pg_sync.cuh"

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
