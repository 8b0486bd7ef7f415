// The paged MoE worker's page products at one input row (mk_moe_pages.cuh pg_compute), in their own header so that
// benchmarks/page_math.cu times the kernel's code, not a copy. Self-contained: no kernel parameters.
#pragma once
#include "mk_math.cuh"

typedef __nv_bfloat16 bf16;

// One warp: rows r < nr (at most RMAX) of the page at W (rows of K elements, contiguous) times x (K elements), the
// dot products in fp32 into out[r] (lane 0). Each lane takes 16-byte chunks lane, lane + 32, ...; x's chunk is read
// once for all the page's rows.
template <int RMAX>
__device__ __forceinline__ void pg_rows(const bf16* W, const bf16* x, int nr, int K, float* out) {
    const int lane = threadIdx.x & 31, KC = K >> 3;
    float acc[RMAX];
#pragma unroll
    for (int r = 0; r < RMAX; r++) acc[r] = 0.f;
    const uint4* wv = reinterpret_cast<const uint4*>(W);
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (int c = lane; c < KC; c += 32) {
        float xf[8];
        unpack8(xv[c], xf);
#pragma unroll
        for (int r = 0; r < RMAX; r++) {
            if (r < nr) {
                float wf[8];
                unpack8(wv[(size_t)r * KC + c], wf);
#pragma unroll
                for (int e = 0; e < 8; e++) acc[r] = fmaf(wf[e], xf[e], acc[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RMAX; r++) {
        if (r < nr) {
            const float v = warp_sum(acc[r]);
            if (lane == 0) out[r] = v;
        }
    }
}

// One warp, the same product on tensor cores (mk_moe_pages.cuh uses it under MK_PG_SEG_TC), with the page's weight rows
// as the MMA's A operand and K cut into S segments: A row i is (weight row i / S, segment i % S), B column j segment j
// of x (columns S..7 zero), so C[i][i % S] is a segment's dot product (the other 7 columns of C are waste, against 15
// of 16 rows with x as A); a row's S segment sums meet through shuffles over the lanes that hold them. nr * S <= 16, K
// a multiple of 32 S. Lane (g, t) loads 16 bytes of A rows g and g + 8 and of B column g at k offset 8t of each
// 32-element step (both operands' k order permuted the same way, as pg_compute_rows_tc), and each segment's steps start
// at step s and wrap, so a quarter-warp's 8 lanes read different banks (rows a segment apart are 1 KB apart at North
// dims). Two steps' loads go ahead of their MMAs, into two accumulators. fp32 accumulation; lane (0 of each row's
// group) writes out[r].
template <int S>
__device__ __forceinline__ void pg_rows_seg(const bf16* W, const bf16* x, int nr, int K, float* out) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int KS = K / S, NSTEP = KS >> 5, s = g % S;
    const bf16* a_lo = W + (size_t)min(g / S, nr - 1) * K + s * KS + 8 * t;         // A row g
    const bf16* a_hi = W + (size_t)min((g + 8) / S, nr - 1) * K + s * KS + 8 * t;   // A row g + 8
    const bool has_b = g < S;
    const bf16* b = x + (has_b ? g : 0) * KS + 8 * t;                               // B column g
    const uint4 zero = make_uint4(0, 0, 0, 0);
    float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    int u = s, k = 0;
    for (; k + 2 <= NSTEP; k += 2) {
        uint4 X[2], Y[2], B[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            X[i] = *reinterpret_cast<const uint4*>(a_lo + u * 32);
            Y[i] = *reinterpret_cast<const uint4*>(a_hi + u * 32);
            B[i] = has_b ? *reinterpret_cast<const uint4*>(b + u * 32) : zero;
            u = u + 1 == NSTEP ? 0 : u + 1;
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            mma_bf16(c[i], X[i].x, Y[i].x, X[i].y, Y[i].y, B[i].x, B[i].y);
            mma_bf16(c[i], X[i].z, Y[i].z, X[i].w, Y[i].w, B[i].z, B[i].w);
        }
    }
    if (k < NSTEP) {                          // (an odd step count)
        const uint4 X = *reinterpret_cast<const uint4*>(a_lo + u * 32);
        const uint4 Y = *reinterpret_cast<const uint4*>(a_hi + u * 32);
        const uint4 B = has_b ? *reinterpret_cast<const uint4*>(b + u * 32) : zero;
        mma_bf16(c[0], X.x, Y.x, X.y, Y.y, B.x, B.y);
        mma_bf16(c[0], X.z, Y.z, X.w, Y.w, B.z, B.w);
    }
    // lane (g, t) holds C[g][2t..2t+1] and C[g + 8][2t..2t+1]; A rows g and g + 8 (segment s: 8 % S == 0) want
    // column s, which lanes t = s / 2 hold
    const bool mine = (s >> 1) == t;
    float lo = mine ? c[0][s & 1] + c[1][s & 1] : 0.f;
    float hi = mine ? c[0][2 + (s & 1)] + c[1][2 + (s & 1)] : 0.f;
#pragma unroll
    for (int m = 1; m < 4 * S; m <<= 1) {     // over lane bits 0-1 (t) and the low log2(S) bits of g
        lo += __shfl_xor_sync(0xffffffffu, lo, m);
        hi += __shfl_xor_sync(0xffffffffu, hi, m);
    }
    if (t == 0 && s == 0) {
        const int r_lo = g / S, r_hi = (g + 8) / S;
        if (r_lo < nr) out[r_lo] = lo;
        if (r_hi < nr) out[r_hi] = hi;
    }
}
