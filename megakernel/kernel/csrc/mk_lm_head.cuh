// The LM head's streaming task (runs of tiles double-buffered inside the task) and the greedy ARGMAX over the LM
// head's maxima; the one-tile LM task and the epilogue they share are GEMV tasks (mk_gemv.cuh).
#pragma once
#include "mk_common.cuh"
#include "mk_gemv.cuh"

// A streaming LM-head task (record a3 > 0): rows a0..a0+a1 in tiles of a3 rows through two weight buffers of lm_wbuf
// bytes (inputs after both): tile t + 2 is issued as soon as the math on tile t is done, so the SM keeps loading
// through every tile's math and epilogue; one maximum per row for the whole run (ARGMAX reads one per task).
__device__ __noinline__ bool task_lm_stream(const Params& P, const int* rec, int ticket) {
    const int r_first = rec[RF_A0], n_rows = rec[RF_A1], rows = rec[RF_A3];
    const int H = PI(H), Bm = PI(Bm), B = PI(B), L = PI(L), wb = PI(lm_wbuf);
    const int n_t = (n_rows + rows - 1) / rows;
    bf16* sW0 = reinterpret_cast<bf16*>(smem + SM_W);
    bf16* sW1 = reinterpret_cast<bf16*>(smem + SM_W + wb);
    bf16* sX = reinterpret_cast<bf16*>(smem + SM_W + 2 * (size_t)wb);
    if (!smem_fits(P, SM_W + 2 * (size_t)wb + (size_t)B * row_pitch(H) * 2, ticket) ||
        (size_t)rows * row_pitch(H) * 2 > (size_t)wb) {
        drain_weights();
        return false;
    }
    const bf16* W = PP(const bf16*, lm_head) + (size_t)r_first * H;
    auto issue = [&](int t) {               // all threads call it; warp 0 issues tile t into buffer t & 1
        if (threadIdx.x < 32)
            issue_weights_w0((t & 1) ? sW1 : sW0, W + (size_t)t * rows * H, min(rows, n_rows - t * rows), nullptr, 0,
                             H, t & 1);
    };
    issue(0);
    if (n_t > 1) issue(1);
    prof_mark(PS_ISSUED);
    if (threadIdx.x < B) s_xrow[threadIdx.x] = PP(const bf16*, x) + ((size_t)L * Bm + threadIdx.x) * H;
    if (!wait_rec(P, rec, ticket)) { drain_weights(); return false; }
    load_x(sX, B, H);
    float bv = -INFINITY;
    int bi = 0x7fffffff;
#if MK_PROFILE
    long long first_landed = 0;
#endif
    for (int t = 0; t < n_t; t++) {
        const int buf = t & 1, r0 = t * rows, nr = min(rows, n_rows - r0);
        wait_weights(buf);                  // (its barrier also publishes sX the first time)
#if MK_PROFILE
        if (t == 0 && threadIdx.x == 0) first_landed = s_prof[PS_LANDED];
#endif
        gemv_at(buf ? sW1 : sW0, sX, nr, H, B);        // ends on a barrier: buffer `buf` is read
        if (t + 2 < n_t) issue(t + 2);
        lm_epilogue(P, r_first + r0, nr, bv, bi);
    }
#if MK_PROFILE
    if (threadIdx.x == 0) s_prof[PS_LANDED] = first_landed;   // the run's first tile: what its wait covered
    prof_mark(PS_COMPUTED);
#endif
    lm_store_best(P, rec[RF_A2], bv, bi);
    task_signal(P, rec[RF_SIG]);
    return true;
}

// ---- ARGMAX: the greedy token of every row from the LM-head tiles' maxima ---------------------------------------
__device__ bool task_argmax(const Params& P, const int* rec, int ticket) {
    if (!wait_rec(P, rec, ticket)) return false;
    const int n = rec[RF_A0], B = PI(B), Bm = PI(Bm);
    const float* best = PP(const float*, lm_best);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int b = warp; b < B; b += NW) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int t = lane; t < n; t += 32) {
            const float v = ldcg_f(best + ((size_t)t * Bm + b) * 2);
            const int i = (int)ldcg_f(best + ((size_t)t * Bm + b) * 2 + 1);
            if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
        }
        warp_argmax(bv, bi);
        if (lane == 0) PP(int*, tokens)[b] = bi;
    }
    task_signal(P, rec[RF_SIG]);
    return true;
}
