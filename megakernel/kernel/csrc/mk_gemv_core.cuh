// The GEMV cores: a weight tile in shared memory (mk_loader.cuh's layout) times up to MB input rows, on tensor cores
// (more than one row) or CUDA cores (one row: x's slice in registers), into sOut.
#pragma once
#include "mk_loader.cuh"

// Warps 0..NWC-1, after the tensor-core cores' (16-row block, K slice) items: the slices' partial sums in sRed
// ([slice][block][16 rows][MB]) added in slice order (deterministic) into sOut, between the barriers that publish
// sRed and then sOut.
template <int NWC>
__device__ __forceinline__ void sum_k_slices(const float* sRed, float* sOut, int R, int nb, int KS, int RB) {
    group_sync<NWC>();
    for (int i = threadIdx.x; i < R * nb; i += NWC * 32) {
        const int r = i / nb, b = i - r * nb, rb = r >> 4;
        float sum = 0.f;
        for (int ks = 0; ks < KS; ks++) sum += sRed[((size_t)(ks * RB + rb) * 16 + (r & 15)) * MB + b];
        sOut[r * MB + b] = sum;
    }
    group_sync<NWC>();
}

// sOut[r * MB + b] = dot(W[r, :], X[b, :]) in fp32 for r < R, b < nb, on tensor cores. W rows are the MMA's M
// (16-row blocks), the input rows its N (NB blocks of 8), K in steps of 32: lane (g, t) loads 16 bytes of weight
// rows g and g + 8 and of input row g at k offset 8t of the step, i.e. the step's k order is permuted the same way
// for both operands (the two MMAs of a step take words 0-1 and 2-3 of each load). A warp takes one (row block,
// K slice) item; the K slices' partial sums meet in sRed and are added in slice order (deterministic). Rows past
// R and inputs past nb read clamped (valid) rows whose outputs are dropped.
template <int NB, int NWC = NW>
__device__ __forceinline__ void gemv_core(const bf16* sW, const bf16* sX, int R, int K, int nb) {
    float* sRed = reinterpret_cast<float*>(smem + SM_RED);
    float* sOut = reinterpret_cast<float*>(smem + SM_OUT);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int pitch = row_pitch(K);
    const int RB = (R + 15) >> 4;
    const int KS = max(1, NWC / RB);
    const int steps = (K + 31) >> 5;
    const bool tail = (K & 31) != 0;
    for (int it = warp; it < RB * KS; it += NWC) {
        const int rb = it / KS, ks = it - rb * KS;
        const int s0 = (ks * steps) / KS, s1 = ((ks + 1) * steps) / KS;
        const bf16* wa = sW + (size_t)min(rb * 16 + g, R - 1) * pitch + 8 * t;
        const bf16* wc = sW + (size_t)min(rb * 16 + g + 8, R - 1) * pitch + 8 * t;
        const bf16* xr[NB];
#pragma unroll
        for (int j = 0; j < NB; j++) xr[j] = sX + (size_t)min(j * 8 + g, nb - 1) * pitch + 8 * t;
        float c[NB][4];
#pragma unroll
        for (int j = 0; j < NB; j++) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;
#pragma unroll 2
        for (int s = s0; s < s1; s++) {
            const bool in = !tail || s * 32 + 8 * t < K;        // past K: zeros, and no load past the last row
            const uint4 zero = make_uint4(0, 0, 0, 0);
            const uint4 A = in ? *reinterpret_cast<const uint4*>(wa + s * 32) : zero;
            const uint4 C = in ? *reinterpret_cast<const uint4*>(wc + s * 32) : zero;
#pragma unroll
            for (int j = 0; j < NB; j++) {
                const uint4 X = in ? *reinterpret_cast<const uint4*>(xr[j] + s * 32) : zero;
                mma_bf16(c[j], A.x, C.x, A.y, C.y, X.x, X.y);
                mma_bf16(c[j], A.z, C.z, A.w, C.w, X.z, X.w);
            }
        }
        // c[j][0..1]: rows rb*16 + g, inputs j*8 + 2t, +1; c[j][2..3]: row + 8
        float* red = sRed + (size_t)(ks * RB + rb) * 16 * MB;
#pragma unroll
        for (int j = 0; j < NB; j++) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int r = g + (q >> 1) * 8, b = j * 8 + 2 * t + (q & 1);
                if (b < nb) red[r * MB + b] = c[j][q];
            }
        }
    }
    sum_k_slices<NWC>(sRed, sOut, R, nb, KS, RB);
}

// The CUDA-core variant (MK_GEMV_TC=0): each warp takes (row, K-slice) items, x re-read from shared memory per row.
template <int BM, int NWC = NW>
__device__ __forceinline__ void gemv_core_cc(const bf16* sW, const bf16* sX, int R, int K, int nb) {
    const int pitch = row_pitch(K);
    float* sRed = reinterpret_cast<float*>(smem + SM_RED);
    float* sOut = reinterpret_cast<float*>(smem + SM_OUT);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int KC = K >> 3;
    const int KS = (R >= NWC) ? 1 : (NWC / R);
    const int items = R * KS;
    for (int it = warp; it < items; it += NWC) {
        const int r = it / KS, ks = it - r * KS;
        const int c0 = (ks * KC) / KS, c1 = ((ks + 1) * KC) / KS;
        float acc[BM];
#pragma unroll
        for (int b = 0; b < BM; b++) acc[b] = 0.f;
        const uint4* wrow = reinterpret_cast<const uint4*>(sW + (size_t)r * pitch);
        for (int c = c0 + lane; c < c1; c += 32) {
            float wf[8];
            unpack8(wrow[c], wf);
#pragma unroll
            for (int b = 0; b < BM; b++) {
                if (b < nb) {
                    float xf[8];
                    unpack8(reinterpret_cast<const uint4*>(sX + (size_t)b * pitch)[c], xf);
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[b] = fmaf(wf[e], xf[e], acc[b]);
                }
            }
        }
#pragma unroll
        for (int b = 0; b < BM; b++) {
            const float v = warp_sum(acc[b]);
            if (lane == 0 && b < nb) sRed[it * MB + b] = v;
        }
    }
    group_sync<NWC>();
    for (int i = threadIdx.x; i < R * nb; i += NWC * 32) {
        const int r = i / nb, b = i - r * nb;
        float s = 0.f;
        for (int ks = 0; ks < KS; ks++) s += sRed[(r * KS + ks) * MB + b];
        sOut[r * MB + b] = s;
    }
    group_sync<NWC>();
}

// One input row (MK_GEMV_B1): warp w takes K slice w % KS of rows w / KS, w / KS + NWC / KS, ... with its slice of
// x unpacked to fp32 in registers once, so only weights are read from shared memory. Rows go two at a time: both
// rows' CPL 16-byte loads per lane in flight together, two accumulators per row, and one transposed butterfly that
// leaves row a's sum in lane 0 and row b's in lane 16 (5 shuffles for two rows). Lanes past the slice's end read
// the slice's last chunk (in the tile) against zeros of x, so no load is predicated. KS is a power of two dividing
// NWC (a warp's slice never changes) with at most 32 * CPL <= 128 chunks of 8 elements per slice (x's 32 registers:
// more made the kernel's entry function spill). KS == 1: each row's sum goes straight to sOut; else the slices' sums
// meet in sRed and are added in slice order (deterministic). (The loop it replaces re-read x for every row and
// chained every FMA of a lane on one accumulator: ~2.9 us per 128 KB tile, and ~11K instructions per tile.)
template <int CPL, int NWC>
__device__ __forceinline__ void gemv_core_b1(const bf16* sW, const bf16* sX, int R, int K, int lks) {
    float* sRed = reinterpret_cast<float*>(smem + SM_RED);
    float* sOut = reinterpret_cast<float*>(smem + SM_OUT);
    const int KS = 1 << lks;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int KC = K >> 3, pitch = row_pitch(K) >> 3;          // in 16-byte chunks
    const int ks = warp & (KS - 1);
    const int cs = (ks * KC) >> lks, ce = ((ks + 1) * KC) >> lks;
    int col[CPL];                                               // this lane's chunks, clamped into the slice
    float xf[CPL][8];
    const uint4* xv = reinterpret_cast<const uint4*>(sX);
#pragma unroll
    for (int i = 0; i < CPL; i++) {
        const int c = cs + lane + 32 * i;
        col[i] = min(c, ce - 1);
        unpack8(c < ce ? xv[c] : make_uint4(0, 0, 0, 0), xf[i]);
    }
    const int n = R << lks, hi = lane >> 4;
    const uint4* wbase = reinterpret_cast<const uint4*>(sW);
    for (int it = warp; it < n; it += 2 * NWC) {
        const int ra = it >> lks, itb = it + NWC, rb = min(itb, n - 1) >> lks;   // row b: a copy of the last one
        const uint4* wa = wbase + (size_t)ra * pitch;
        const uint4* wb = wbase + (size_t)rb * pitch;
        uint4 A[CPL], B[CPL];
#pragma unroll
        for (int i = 0; i < CPL; i++) { A[i] = wa[col[i]]; B[i] = wb[col[i]]; }
        float a0 = 0.f, a1 = 0.f, b0 = 0.f, b1 = 0.f;
#pragma unroll
        for (int i = 0; i < CPL; i++) {
            float fa[8], fb[8];
            unpack8(A[i], fa);
            unpack8(B[i], fb);
#pragma unroll
            for (int e = 0; e < 8; e += 2) {
                a0 = fmaf(fa[e], xf[i][e], a0); a1 = fmaf(fa[e + 1], xf[i][e + 1], a1);
                b0 = fmaf(fb[e], xf[i][e], b0); b1 = fmaf(fb[e + 1], xf[i][e + 1], b1);
            }
        }
        const float va = a0 + a1, vb = b0 + b1;
        float v = (hi ? vb : va) + __shfl_xor_sync(0xffffffffu, hi ? va : vb, 16);
#pragma unroll
        for (int o = 8; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if ((lane & 15) == 0 && (hi == 0 || itb < n)) {
            const int r = hi ? rb : ra;
            if (KS == 1) sOut[r * MB] = v;
            else sRed[hi ? itb : it] = v;
        }
    }
    group_sync<NWC>();
    if (KS == 1) return;
    for (int r = threadIdx.x; r < R; r += NWC * 32) {
        float sum = 0.f;
        for (int k = 0; k < KS; k++) sum += sRed[r * KS + k];
        sOut[r * MB] = sum;
    }
    group_sync<NWC>();
}

// One input row on all NW warps: the K slicing and the instantiation for the slice's chunks per lane; a K too long
// for 16 slices of 4 chunks per lane, or a warp count that is not NW, takes the loop above.
template <int NWC>
__device__ __forceinline__ void gemv_one_row(const bf16* sW, const bf16* sX, int R, int K) {
#if MK_GEMV_B1
    if constexpr (NWC == NW) {
        const int KC = K >> 3;
        // log2 of the K slices per row: at most 128 chunks per slice; more slices to give every warp rows while a
        // slice keeps 32 chunks or more (never an empty one)
        int lks = 0;
        while ((1 << lks) < NWC && (KC > (128 << lks) || ((R << lks) < NWC && (KC >> (lks + 1)) >= 32))) lks++;
        const int cpl = ((((KC + (1 << lks) - 1) >> lks)) + 31) >> 5;
        switch (cpl) {
            case 1: gemv_core_b1<1, NWC>(sW, sX, R, K, lks); return;
            case 2: gemv_core_b1<2, NWC>(sW, sX, R, K, lks); return;
            case 3: gemv_core_b1<3, NWC>(sW, sX, R, K, lks); return;
            case 4: gemv_core_b1<4, NWC>(sW, sX, R, K, lks); return;
            default: break;
        }
    }
#endif
    gemv_core_cc<1, NWC>(sW, sX, R, K, 1);
}

// The tile at sW times the nb rows at sX on warps 0..NWC-1.
template <int NWC>
__device__ __forceinline__ void gemv_on(const bf16* sW, const bf16* sX, int R, int K, int nb) {
#if MK_GEMV_TC
    if (nb <= 1) gemv_one_row<NWC>(sW, sX, R, K);
    else if (nb <= 8) gemv_core<1, NWC>(sW, sX, R, K, nb);
    else gemv_core<2, NWC>(sW, sX, R, K, nb);
#else
    if (nb <= 1) gemv_one_row<NWC>(sW, sX, R, K);
    else if (nb <= 2) gemv_core_cc<2, NWC>(sW, sX, R, K, nb);
    else if (nb <= 4) gemv_core_cc<4, NWC>(sW, sX, R, K, nb);
    else if (nb <= 8) gemv_core_cc<8, NWC>(sW, sX, R, K, nb);
    else gemv_core_cc<16, NWC>(sW, sX, R, K, nb);
#endif
}

// The tile at sW times the nb rows at sX on every warp (not inlined: one copy of the three cores for its callers).
__device__ __noinline__ void gemv_at(const bf16* sW, const bf16* sX, int R, int K, int nb) { gemv_on<NW>(sW, sX, R, K, nb); }

// The tile in weight buffer `buf` times the nb rows in sX.
__device__ __noinline__ void gemv(const Params& P, int buf, int R, int K, int nb) {
    // one row: the CUDA-core loop measured ahead (b1 8K 5.07 vs 5.17 ms/step); more rows: tensor cores (b8 15.98 vs
    // 17.39, b16 25.83 vs 28.92), which read the inputs once per 16 weight rows instead of once per row
    gemv_on<NW>(reinterpret_cast<const bf16*>(smem + sm_w(P, buf)), reinterpret_cast<const bf16*>(smem + sm_x(P, R, K)),
                R, K, nb);
    prof_mark(PS_COMPUTED);                 // after gemv_core's closing barrier: every partial sum is in sOut
}
