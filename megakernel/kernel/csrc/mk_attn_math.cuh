// One computing warp's math on one chunk of an attention split: S = Q K^T for its 16-key slice, the online softmax,
// O += P V. Self-contained (no kernel parameters): task_attn_d (mk_attention.cuh) and benchmarks/attn_stream.cu run
// this same code, so the microbenchmark times the kernel's math. Where Q, K and V sit in shared memory is the
// caller's, through two small interfaces:
//   Q:  frag(ks, a0, a2)  - row g's A-fragment words for k-step ks (g = lane / 4: columns ks*16 + 2t, + 8)
//   KV: k_word(r, c)      - the 32-bit word of K row r at column c (c even)
//       k_addr(r, c)      - (FAST only) the shared-memory address of K row r, column c (16-byte aligned: an
//                           ldmatrix row)
//       v_addr(r, c)      - the same for V
// The MMA is m16n8k16 with the kv head's <= 8 query heads as rows 0-7 and rows 8-15 zero; P is rounded to bf16 as
// the A operand of P V (V through ldmatrix.trans); fp32 accumulation throughout.
//
// MK_ATTN_MATH=1 (FAST), from a SASS audit of the chunk loop (session 26): K's B fragments by ldmatrix, one x4 per
// k-step for both 8-key tiles of the slice (was four 32-bit loads; the padded 272-byte rows are conflict-free for
// both), the k-steps unrolled by 4 (was 2; fully unrolled, the one-warp variant spills 4 bytes at head_dim 128), and
// the exponentials as ex2.approx with log2(e) folded into the scale (the running max then lives in log2 units:
// attn_max_natural converts it for the merge). The audit's other proposals, compiled in session 27 and left out:
// four accumulator chains (even and odd k-steps apart) spill 32 bytes in the one-warp variant, Q's fragments held in
// registers across chunks 144 in the two-warp one, and V's fragments loaded above the softmax are moved back into
// the P V loop by ptxas. A helper's lane-level model of both paths (PTX fragment layouts) matches numpy attention.
#pragma once
#include <cuda_bf16.h>
#include "mk_attn_layout.cuh"

// c[0..1] += A B for rows g (0-7) of a m16n8k16 bf16 MMA whose rows 8-15 are zero: a0/a2 hold row g's columns
// (2t, 2t+1) and (2t+8, 2t+9); the pad rows' outputs are dropped.
__device__ __forceinline__ void mma_rows8(float* c, unsigned a0, unsigned a2, unsigned b0, unsigned b1) {
    float d2 = 0.f, d3 = 0.f;
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(d2), "+f"(d3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// ldmatrix: 4 8x8 tiles whose rows start at the lanes' shared-memory addresses (lanes 8i .. 8i + 7: tile i's rows),
// transposed or not. Lane l receives row l / 4, elements 2 (l % 4) and + 1 of each tile (.trans: of its transpose).
__device__ __forceinline__ void ldsm_x4_trans_s(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldsm_x4_s(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
}

// e^x (FAST: 2^x, the argument already in log2 units; ex2.approx(-inf) = 0 as expf's)
template <bool FAST>
__device__ __forceinline__ float attn_exp(float x) {
    if constexpr (FAST) {
        float y;
        asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
        return y;
    } else {
        return expf(x);
    }
}

// A running max from attn_chunk_math in natural-log units (what the merge and the log-sum-exp use)
template <bool FAST>
__device__ __forceinline__ float attn_max_natural(float m) {
    return FAST ? m * 0.6931471805599453f : m;
}

// Q's gq rows in shared memory, [gq][D + QPAD] bf16 (mk_attn_layout.cuh); rows g >= gq of the MMA tile read as zero.
template <int D, int QPAD>
struct AttnQSmem {
    const __nv_bfloat16* sQ;
    int gq;
    __device__ __forceinline__ void frag(int ks, unsigned& a0, unsigned& a2) const {
        const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
        const __nv_bfloat16* qr = sQ + (size_t)g * q_pitch<D, QPAD>() + ks * 16 + 2 * t4;   // q_word(g, ks*8 + t4)
        a0 = g < gq ? *reinterpret_cast<const unsigned*>(qr) : 0u;
        a2 = g < gq ? *reinterpret_cast<const unsigned*>(qr + 8) : 0u;
    }
};

// K and V rows padded to ROWP elements (the split's ring; MK_ATTN_BULK 0 and 1), the chunk's from row row0 of each.
template <int ROWP>
struct AttnKVPadded {
    const __nv_bfloat16 *sK, *sV;
    int row0;
    __device__ __forceinline__ static unsigned addr(const __nv_bfloat16* p) {
        return (unsigned)__cvta_generic_to_shared(p);
    }
    __device__ __forceinline__ unsigned k_word(int r, int c) const {
        return *reinterpret_cast<const unsigned*>(sK + (size_t)(row0 + r) * ROWP + c);
    }
    __device__ __forceinline__ unsigned k_addr(int r, int c) const { return addr(sK + (size_t)(row0 + r) * ROWP + c); }
    __device__ __forceinline__ unsigned v_addr(int r, int c) const { return addr(sV + (size_t)(row0 + r) * ROWP + c); }
};

// One computing warp's chunk: keys kb .. kb + 15 of the chunk (those < n and >= lo_off are the split's; the others
// get probability 0), against Q's rows; m_run / l_run: row g's running max (scaled scores; log2 units under FAST)
// and this thread's partial sum; o[2 * NPM][2]: row g's output for the NPM 16-dim pairs from np0 on (dims
// (np0 * 2 + nt) * 8 + 2t, + 1).
template <int KS, int NPM, bool FAST, class QSrc, class KV>
__device__ __forceinline__ void attn_chunk_math(const QSrc& q, const KV& kv, int kb, int n, int lo_off, float scale,
                                                int np0, float& m_run, float& l_run, float (*o)[2]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int vr = kb + (lane & 7) + ((lane >> 3) & 1) * 8;   // this lane's V ldmatrix row
    const int vc = (lane >> 4) * 8;
    float sc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};                // keys kb + nt*8 + 2t4 (+1)
    if constexpr (!FAST) {
#pragma unroll 2
        for (int ks = 0; ks < KS; ks++) {
            unsigned qa0, qa2;
            q.frag(ks, qa0, qa2);
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const int r = kb + nt * 8 + g, c = ks * 16 + 2 * t4;
                mma_rows8(sc[nt], qa0, qa2, kv.k_word(r, c), kv.k_word(r, c + 8));
            }
        }
    } else {
        // one ldmatrix.x4 per k-step: K rows kb .. kb + 15 (lanes 16-31: the second 8-key tile), columns ks * 16 and
        // + 8 (lanes 8-15 and 24-31), i.e. both tiles' b0 and b1; Q's fragment read once per k-step
        const int kr = (lane & 7) + (lane >> 4) * 8, kc = ((lane >> 3) & 1) * 8;
#pragma unroll 4
        for (int ks = 0; ks < KS; ks++) {                     // (a full unroll spills 4 bytes at KS 8, one warp)
            unsigned b[4], qa0, qa2;
            ldsm_x4_s(b, kv.k_addr(kb + kr, ks * 16 + kc));
            q.frag(ks, qa0, qa2);
            mma_rows8(sc[0], qa0, qa2, b[0], b[1]);
            mma_rows8(sc[1], qa0, qa2, b[2], b[3]);
        }
    }
    const float sl = FAST ? scale * 1.4426950408889634f : scale;
    float v[4], mx = -INFINITY;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int key = kb + (e >> 1) * 8 + 2 * t4 + (e & 1);
        v[e] = key < n && key >= lo_off ? sc[e >> 1][e & 1] * sl : -INFINITY;
        mx = fmaxf(mx, v[e]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx);           // finite: the slice holds one of the split's keys
    const float alpha = attn_exp<FAST>(m_run - m_new);
    float pr[4];
#pragma unroll
    for (int e = 0; e < 4; e++) pr[e] = attn_exp<FAST>(v[e] - m_new);
    l_run = l_run * alpha + (pr[0] + pr[1] + pr[2] + pr[3]);
    m_run = m_new;
    const unsigned pa0 = pack_bf16x2(pr[0], pr[1]), pa2 = pack_bf16x2(pr[2], pr[3]);
#pragma unroll
    for (int i = 0; i < NPM; i++) {
        unsigned b[4];
        ldsm_x4_trans_s(b, kv.v_addr(vr, (np0 + i) * 16 + vc));
        o[2 * i][0] *= alpha; o[2 * i][1] *= alpha;
        o[2 * i + 1][0] *= alpha; o[2 * i + 1][1] *= alpha;
        mma_rows8(o[2 * i], pa0, pa2, b[0], b[1]);
        mma_rows8(o[2 * i + 1], pa0, pa2, b[2], b[3]);
    }
}
