// The paged MoE worker's page products (mk_pg_items.cuh pg_compute at one input row, pg_compute_rows[_tc] at
// several), in their own header so that benchmarks/page_math.cu times the kernel's code, not a copy. Self-contained:
// no kernel parameters.
#pragma once
#include "mk_math.cuh"

typedef __nv_bfloat16 bf16;

// MK_PG_TC_ACC: accumulators per weight-row group in pg_compute_rows_tc (1, or 2: even and odd K steps apart).
#ifndef MK_PG_TC_ACC
#define MK_PG_TC_ACC 1
#endif
static_assert(MK_PG_TC_ACC == 1 || MK_PG_TC_ACC == 2, "MK_PG_TC_ACC is 1 or 2");

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

// One warp, the same product on tensor cores (mk_pg_items.cuh uses it under MK_PG_SEG_TC), with the page's weight rows
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

// One warp, an item of several input rows: rows r < nr of the page at W times input rows i < nc (row i at
// xrow(i), K elements each), the fp32 dot products into out[i * ostride + r] (lane 0). Weight rows and inputs go in
// groups of 4 (16 accumulators); each lane takes 16-byte chunks lane, lane + 32, ... of both.
template <class XRow>
__device__ __forceinline__ void pg_compute_rows(const bf16* W, int nr, int nc, int K, XRow xrow, float* out,
                                                int ostride) {
    const int lane = threadIdx.x & 31, KC = K >> 3;
    const uint4* wv = reinterpret_cast<const uint4*>(W);
    for (int i0 = 0; i0 < nc; i0 += 4) {
        const uint4* xv[4];
#pragma unroll
        for (int i = 0; i < 4; i++) xv[i] = reinterpret_cast<const uint4*>(xrow(min(i0 + i, nc - 1)));
        for (int r0 = 0; r0 < nr; r0 += 4) {
            float acc[4][4];
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[r][i] = 0.f;
            for (int c = lane; c < KC; c += 32) {
                float xf[4][8];
#pragma unroll
                for (int i = 0; i < 4; i++) unpack8(xv[i][c], xf[i]);   // (past nc: row nc - 1 again, unused)
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    if (r0 + r < nr) {
                        float wf[8];
                        unpack8(wv[(size_t)(r0 + r) * KC + c], wf);
#pragma unroll
                        for (int i = 0; i < 4; i++)
#pragma unroll
                            for (int e = 0; e < 8; e++) acc[r][i] = fmaf(wf[e], xf[i][e], acc[r][i]);
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    if (r0 + r < nr && i0 + i < nc) {
                        const float v = warp_sum(acc[r][i]);
                        if (lane == 0) out[(size_t)(i0 + i) * ostride + r0 + r] = v;
                    }
        }
    }
}

// The same product on tensor cores (MK_GEMV_TC): the input rows are the MMA's M (rows i and i + 8 of the 16-row
// operand; past nc: zeros when nc <= 8, else clamped rows whose outputs are dropped), the page's weight rows its N
// in groups of 8, K in steps of 32 with the step's k order permuted the same way for both operands (lane (g, t)
// loads 16 bytes of input row g (and g + 8) and of weight row g of the group at k offset 8t; the two MMAs of a step
// take words 0-1 and 2-3), as gemv_core. fp32 accumulation; each lane ends with its (input, row) sums, no shuffle.
// A gate/up page at North dims (4 rows of 2048) takes 128 MMAs and 128 shared loads per lane, where the CUDA-core
// loop above issues ~3,200 instructions per lane at 8 rows: at b8 that loop, not the HBM, bounded the MoE phase.
// Every MMA of a weight-row group adds into one accumulator (MK_PG_TC_ACC=1), so a gate/up page is a chain of 128
// dependent MMAs (64 steps of 2), a down page two of 48; MK_PG_TC_ACC=2 alternates the steps between two accumulators
// (chains half as long, the same products summed in another order).
template <class XRow, int ACC = MK_PG_TC_ACC>
__device__ __forceinline__ void pg_compute_rows_tc(const bf16* W, int nr, int nc, int K, XRow xrow, float* out,
                                                   int ostride) {
    static_assert(ACC == 1 || ACC == 2, "MK_PG_TC_ACC is 1 or 2");
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool hi = nc > 8;                   // input rows 8..15 present
    const bf16* xa = xrow(min(g, nc - 1)) + 8 * t;
    const bf16* xb = xrow(min(g + 8, nc - 1)) + 8 * t;
    const int steps = (K + 31) >> 5;
    const bool tail = (K & 31) != 0;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int r0 = 0; r0 < nr; r0 += 8) {
        const bf16* wr = W + (size_t)min(r0 + g, nr - 1) * K + 8 * t;
        // step s's operands (past K: zeros, and no read past the row), and its two MMAs into acc
        const auto load = [&](int s, uint4& X, uint4& Y, uint4& B) {
            const bool in = !tail || s * 32 + 8 * t < K;
            X = in ? *reinterpret_cast<const uint4*>(xa + s * 32) : zero;
            Y = (in && hi) ? *reinterpret_cast<const uint4*>(xb + s * 32) : zero;
            B = in ? *reinterpret_cast<const uint4*>(wr + s * 32) : zero;
        };
        const auto mma_step = [](float* acc, const uint4& X, const uint4& Y, const uint4& B) {
            mma_bf16(acc, X.x, Y.x, X.y, Y.y, B.x, B.y);
            mma_bf16(acc, X.z, Y.z, X.w, Y.w, B.z, B.w);
        };
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        if constexpr (ACC == 2) {
            // even and odd steps into two accumulators: two chains of MMAs, each half as long
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            int s = 0;
#pragma unroll 2
            for (; s + 2 <= steps; s += 2) {
                uint4 X0, Y0, B0, X1, Y1, B1;
                load(s, X0, Y0, B0);
                load(s + 1, X1, Y1, B1);
                mma_step(c, X0, Y0, B0);
                mma_step(d, X1, Y1, B1);
            }
            if (s < steps) {                      // (an odd step count)
                uint4 X, Y, B;
                load(s, X, Y, B);
                mma_step(c, X, Y, B);
            }
#pragma unroll
            for (int q = 0; q < 4; q++) c[q] += d[q];
        } else {
#pragma unroll 4
            for (int s = 0; s < steps; s++) {
                uint4 X, Y, B;
                load(s, X, Y, B);
                mma_step(c, X, Y, B);
            }
        }
        // c[0..1]: input row g, weight rows r0 + 2t, + 1; c[2..3]: input row g + 8
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int i = g + (q >> 1) * 8, r = r0 + 2 * t + (q & 1);
            if (i < nc && r < nr) out[(size_t)i * ostride + r] = c[q];
        }
    }
}
