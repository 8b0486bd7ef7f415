// Weight tiles in the 128-byte swizzled layout of TMA tensor copies, and the tensor-core GEMV core that reads them
// without bank conflicts. benchmarks/gemv_stream.cu's swz_* modes measure them; the megakernel used them for the plain
// MoE worker's expert tiles behind MK_SWZ until session 26 (measured slower; not part of its build since).
//
// Why: the plain layout keeps a tile's rows K * 2 bytes apart (4096 B at K = 2048), so the 8 weight rows of an MMA
// fragment, read at the same k, fall in the same banks (Nsight Compute on the tensor-core core at 8 input rows: 7.1-way
// conflicts, half of its shared wavefronts excessive). A tensor copy can swizzle while it copies, from the plain
// layout in global memory, so prefill and the other backends keep their weights as they are.
//
// Layout: a tile of R rows x K columns (K a multiple of 64) is K / 64 boxes of R rows x 64 elements (128 B each);
// box kb sits at byte kb * R * 128 of the tile, its row r at line L = kb * R + r. The copy stores 16-byte chunk c of
// a line (elements 8c..8c+7 of the box's row) at chunk c ^ (A & 7), where A is the line's absolute shared-memory
// line number (address >> 7): the hardware's 128-byte swizzle, a function of the address.
#pragma once
#include <cuda.h>
#include "mk_gemv.cuh"

// One warp: a tile of R = n0 + n1 rows (halves y0.. and y1.., multiples of bh rows) of a 3D map whose box is bh
// rows of every column (mk_tmap_encode_swizzled_3d with box_rows bh) into sW (1024-byte aligned) as R / bh
// sub-tiles of bh rows, one tensor copy each: sub-tile q at byte q * bh * K * 2, inside it column block kb at
// kb * bh * 128 and row r at r * 128. With bh = R (one half) that is the 2D boxes' layout in ONE copy, where they
// take (K / 64) x (R / box rows); with bh = 16 the layout gemv_core_swz<.., true> reads. Completing on buffer buf's
// mbarrier. (benchmarks/gemv_stream.py --swz-box-rows -1 and -16 measure both.)
__device__ __noinline__ void issue_tile_swz3d(bf16* sW, const CUtensorMap* map3, int y0, int n0, int y1, int n1,
                                              int K, int buf, int bh) {
    const int lane = threadIdx.x & 31;
    const int q0 = n0 / bh, nq = q0 + n1 / bh;        // (the callers keep both halves multiples of bh rows)
    if (lane == 0) {
        s_wpend[buf] = 1;
        fence_proxy_async();
        mbar_expect_tx(&s_wbar[buf], (unsigned)nq * (unsigned)bh * (unsigned)K * 2u);   // exactly what the copies bring
    }
    __syncwarp();
    fence_proxy_async();
    const unsigned long long pol = l2_evict_first();
    for (int q = lane; q < nq; q += 32) {
        const int y = q < q0 ? y0 + bh * q : y1 + bh * (q - q0);
        bulk_tensor_3d(reinterpret_cast<char*>(sW) + (size_t)q * bh * K * 2, map3, 0, y, 0, &s_wbar[buf], pol);
    }
}

// One warp: a tile of two halves, rows y0..y0+n0-1 then y1..y1+n1-1 (every column) of the map's matrix, into sW
// (1024-byte aligned) as one swizzled tile of R = n0 + n1 rows, completing on weight buffer buf's mbarrier:
// (K / 64) x (R / box_rows) tensor copies, each a box of 64 columns x box_rows rows (the map's box; 128-byte
// swizzle), spread over the lanes. Box (kb, j) lands at lines kb * R + (its first row in the tile).., so the layout
// is the same whatever the box height (box_rows divides n0 and n1, R a multiple of 8).
__device__ __noinline__ void issue_tile_swz(bf16* sW, const CUtensorMap* map, int y0, int n0, int y1, int n1, int K,
                                            int buf, int box_rows) {
    const int lane = threadIdx.x & 31;
    const int R = n0 + n1;
    if (lane == 0) {
        s_wpend[buf] = 1;
        fence_proxy_async();
        mbar_expect_tx(&s_wbar[buf], (unsigned)R * (unsigned)K * 2u);
    }
    __syncwarp();
    fence_proxy_async();
    const unsigned long long pol = l2_evict_first();
    const int nkb = K >> 6, b0 = n0 / box_rows, nbox = b0 + n1 / box_rows;
    for (int i = lane; i < nkb * nbox; i += 32) {
        const int kb = i % nkb, j = i / nkb;
        const int r = j < b0 ? j * box_rows : n0 + (j - b0) * box_rows;      // its first row in the tile
        const int y = j < b0 ? y0 + j * box_rows : y1 + (j - b0) * box_rows;  // and in the matrix
        bulk_tensor_2d(reinterpret_cast<char*>(sW) + ((size_t)kb * R + r) * 128, map, kb * 64, y, &s_wbar[buf], pol);
    }
}

// Fragment row g (0..7) of a 16-row block reads local row swz_perm(g) (and that + 8). The 8 lanes of a quarter warp
// (g = 2q, 2q + 1; t = 0..3) then read two rows whose swizzles differ in bit 2 (with R a multiple of 8): the two
// halves of the 128-byte line, every bank once. The outputs go back to their physical rows.
__device__ __forceinline__ int swz_perm(int g) { return ((g & 1) << 2) | (g >> 1); }

// One k step (32 columns) of the swizzled core: fragment rows at a / c (byte addresses of the step's chunks in the
// tile), input chunk pointers x[j] (the step's 8 elements of this lane), into accumulators c.
template <int NB>
__device__ __forceinline__ void swz_step(const char* a, const char* cr, const bf16* const* x, int s, float (*c)[4]) {
    const uint4 A = *reinterpret_cast<const uint4*>(a);
    const uint4 C = *reinterpret_cast<const uint4*>(cr);
#pragma unroll
    for (int j = 0; j < NB; j++) {
        const uint4 X = *reinterpret_cast<const uint4*>(x[j] + s * 32);
        mma_bf16(c[j], A.x, C.x, A.y, C.y, X.x, X.y);
        mma_bf16(c[j], A.z, C.z, A.w, C.w, X.z, X.w);
    }
}

// sOut[r * MB + b] = dot(W[r, :], X[b, :]) in fp32 for r < R, b < nb, from a swizzled tile (K a multiple of 64, R a
// multiple of 8) and inputs of pitch xpitch elements (K + 32: a 64-byte pad puts the 8 input rows of a fragment in
// different banks). As gemv_core: a warp takes one (16-row block, K slice) item, the slices meet in sRed in slice
// order. Step s reads chunk 4s + t of its rows: box s / 2, chunk (s & 1) * 4 + t of the line, whose swizzle
// (line0 + row) & 7 is the same in every box since R is a multiple of 8, so a step's addresses are a base, the box
// offset and one of two per-lane constants. Two accumulator sets take alternate steps (two MMA chains in flight).
// Rows past R read row R - 1 (dropped).
// SUB16: the tile is R / 16 sub-tiles of 16 rows (issue_tile_swz3d's layout with bh = 16): row r's line in column
// block kb is (r >> 4) * 16 * (K / 64) + kb * 16 + (r & 15), the same swizzle value (line0 + r) & 7 since 16 is a
// multiple of 8.
template <int NB, int NWC = NW, bool SUB16 = false>
__device__ __forceinline__ void gemv_core_swz(const bf16* sW, const bf16* sX, int xpitch, int R, int K, int nb) {
    float* sRed = reinterpret_cast<float*>(smem + SM_RED);
    float* sOut = reinterpret_cast<float*>(smem + SM_OUT);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int RB = (R + 15) >> 4, KS = max(1, NWC / RB), steps = K >> 5;
    const char* w = reinterpret_cast<const char*>(sW);
    const unsigned line0 = smem_addr(sW) >> 7;
    const size_t box = (size_t)(SUB16 ? 16 : R) * 128;
    for (int it = warp; it < RB * KS; it += NWC) {
        const int rb = it / KS, ks = it - rb * KS;
        const int s0 = (ks * steps) / KS, s1 = ((ks + 1) * steps) / KS;
        const int pa = rb * 16 + swz_perm(g), pc = pa + 8;
        const int ra = min(pa, R - 1), rc = min(pc, R - 1);
        const int va = (int)((line0 + ra) & 7), vc = (int)((line0 + rc) & 7);
        const char* wa = w + (SUB16 ? (size_t)(ra >> 4) * 32 * K + (size_t)(ra & 15) * 128 : (size_t)ra * 128);
        const char* wc = w + (SUB16 ? (size_t)(rc >> 4) * 32 * K + (size_t)(rc & 15) * 128 : (size_t)rc * 128);
        const int oa[2] = {(t ^ va) << 4, ((4 + t) ^ va) << 4}, oc[2] = {(t ^ vc) << 4, ((4 + t) ^ vc) << 4};
        const bf16* xr[NB];
#pragma unroll
        for (int j = 0; j < NB; j++) xr[j] = sX + (size_t)min(j * 8 + g, nb - 1) * xpitch + 8 * t;
        float c0[NB][4], c1[NB][4];
#pragma unroll
        for (int j = 0; j < NB; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) c0[j][q] = c1[j][q] = 0.f;
        int s = s0;
        if (s < s1 && (s & 1)) {             // an odd first step: the second half of its box
            swz_step<NB>(wa + (s >> 1) * box + oa[1], wc + (s >> 1) * box + oc[1], xr, s, c1);
            s++;
        }
        for (; s + 1 < s1; s += 2) {          // a whole box: its two halves
            const size_t b = (size_t)(s >> 1) * box;
            swz_step<NB>(wa + b + oa[0], wc + b + oc[0], xr, s, c0);
            swz_step<NB>(wa + b + oa[1], wc + b + oc[1], xr, s + 1, c1);
        }
        if (s < s1) swz_step<NB>(wa + (s >> 1) * box + oa[0], wc + (s >> 1) * box + oc[0], xr, s, c0);
        // c[j][0..1]: physical row pa, inputs j*8 + 2t, +1; c[j][2..3]: row pc
        float* red = sRed + (size_t)(ks * RB + rb) * 16 * MB;
#pragma unroll
        for (int j = 0; j < NB; j++) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int r = (q < 2 ? pa : pc) - rb * 16, b = j * 8 + 2 * t + (q & 1);
                if (b < nb) red[r * MB + b] = c0[j][q] + c1[j][q];
            }
        }
    }
    sum_k_slices<NWC>(sRed, sOut, R, nb, KS, RB);
}

// The swizzled tile at sW times the nb input rows at sX (pitch xpitch) on every warp; sub16: the tile is in 16-row
// sub-tiles (issue_tile_swz3d, bh = 16), else in whole-tile column blocks (issue_tile_swz, or issue_tile_swz3d with
// bh = R).
__device__ __noinline__ void gemv_swz(const bf16* sW, const bf16* sX, int xpitch, int R, int K, int nb,
                                      bool sub16 = false) {
    if (sub16) {
        if (nb <= 8) gemv_core_swz<1, NW, true>(sW, sX, xpitch, R, K, nb);
        else gemv_core_swz<2, NW, true>(sW, sX, xpitch, R, K, nb);
    } else {
        if (nb <= 8) gemv_core_swz<1>(sW, sX, xpitch, R, K, nb);
        else gemv_core_swz<2>(sW, sX, xpitch, R, K, nb);
    }
}
