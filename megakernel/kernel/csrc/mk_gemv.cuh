// GEMV: the weight-tile core every projection runs on and the static projection tasks (QKV with RoPE and the
// K/V append, O, router, dense/shared MLP, a one-tile LM head task). The streaming LM head and ARGMAX:
// mk_lm_head.cuh.
#pragma once
#include "mk_common.cuh"
#include "mk_norm.cuh"      // residual_row / norm_row: tiles with FLAG_FUSED_NORM normalise their own inputs

// ---- GEMV: a tile of weight rows (staged in shared memory) times up to MB input rows ---------------------------
// Layouts (schedule.smem_bytes sizes both; every weight and input row is padded to a pitch of K + ROW_PAD elements):
//   one buffer (wbuf == 0):   sRed [GEMV_RED_FLOATS] f32 | sOut [64*MB] f32 | sW [R][pitch] bf16 | sX [nb][pitch] bf16
//   two buffers (wbuf > 0):   sRed | sOut | sW0 [wbuf B] | sW1 [wbuf B] | sX [nb][pitch] bf16
// With two buffers a block issues the weights of the task (or MoE item) it runs next into the other buffer before
// it waits for and computes the current one: weights are immutable, so their loads never wait on a counter, and the
// SM keeps loading through the dependency wait, the math, the epilogue and the signal.
#define SM_RED 0
#define SM_OUT (MK_GEMV_RED_FLOATS * 4)
#define SM_W MK_GEMV_SCRATCH_BYTES
__device__ __forceinline__ int row_pitch(int K) { return K + MK_ROW_PAD; }
__device__ __forceinline__ size_t sm_w(const Params& P, int buf) { return SM_W + (size_t)buf * PI(wbuf); }
__device__ __forceinline__ size_t sm_x(const Params& P, int R, int K) {
    return PI(wbuf) ? SM_W + 2 * (size_t)PI(wbuf) : SM_W + (size_t)R * row_pitch(K) * 2;
}
// The expert items' ring of the warp-specialised worker (moe_wbuf > 0): two buffers, the inputs after both.
__device__ __forceinline__ size_t moe_w(const Params& P, int slot) { return SM_W + (size_t)slot * PI(moe_wbuf); }
__device__ __forceinline__ size_t moe_x(const Params& P) { return SM_W + 2 * (size_t)PI(moe_wbuf); }
// end of nb input rows of K elements
__device__ __forceinline__ size_t sm_x_end(const Params& P, int R, int K, int nb) {
    return sm_x(P, R, K) + (size_t)nb * row_pitch(K) * 2;
}

struct Tile {
    const bf16* w0;
    int n0;
    const bf16* w1;
    int n1;
    int K;
};

// The block's prefetch state: s_next is the block's next ticket (claimed ahead by the persistent loop); s_pf_ticket
// the ticket whose weights are in flight in buffer s_pf_buf (a stale value is an older ticket, never matched). At
// most one prefetch is pending, always for the block's next ticket, always a GEMV task; a task kind that is not a
// GEMV starts with nothing in flight. Thread 0 writes them; the loop reads them before its record barrier.
__shared__ int s_pf_ticket, s_pf_buf;      // (s_next: mk_common.cuh)

// Weight loads are bulk copies (TMA) completing on the buffer's mbarrier: one copy per tile half (contiguous rows),
// or with ROW_PAD one per row, spread over the lanes of the issuing warp. No thread stalls issuing thousands of 16-byte copies, so a prefetch
// costs the block nothing while the current tile still lands. s_wphase[b]: the parity the next completion of buffer
// b will have; s_wpend[b]: a load into b is in flight.
__shared__ __align__(8) unsigned long long s_wbar[2];
__shared__ int s_wphase[2], s_wpend[2];

// Thread 0, once per launch before the first barrier.
__device__ __forceinline__ void init_weight_buffers() {
    for (int b = 0; b < 2; b++) { mbar_init(&s_wbar[b], 1); s_wphase[b] = 0; s_wpend[b] = 0; }
    fence_mbar_init();
}

// One warp: lane 0 arms the mbarrier with the tile's bytes, then the lanes issue the copies.
__device__ __noinline__ void issue_weights_w0(bf16* sW, const bf16* w0, int n0, const bf16* w1, int n1, int K, int buf) {
    const int lane = threadIdx.x & 31;
    const unsigned row_bytes = (unsigned)K * 2;
    if (lane == 0) {
        s_wpend[buf] = 1;                    // before the arrive: its release publishes the flag with the meta
        fence_proxy_async();                 // earlier generic reads/writes of this memory before the async writes
        mbar_expect_tx(&s_wbar[buf], row_bytes * (unsigned)(n0 + n1));
    }
    __syncwarp();
    fence_proxy_async();
    const unsigned long long pol = l2_evict_first();
#if MK_ROW_PAD
    const int pitch = row_pitch(K);
    for (int r = lane; r < n0 + n1; r += 32) {
        const bf16* src = r < n0 ? w0 + (size_t)r * K : w1 + (size_t)(r - n0) * K;
        bulk_load(sW + (size_t)r * pitch, src, row_bytes, &s_wbar[buf], pol);
    }
#else                                        // contiguous rows: one copy per tile half
    if (lane == 0) bulk_load(sW, w0, row_bytes * n0, &s_wbar[buf], pol);
    if (lane == 1 && n1) bulk_load(sW + (size_t)n0 * K, w1, row_bytes * n1, &s_wbar[buf], pol);
#endif
}

// Starts the copy of the tile's weights into weight buffer `buf` (immutable: safe before any wait). All threads call
// it (uniformly); warp 0 issues. The buffer's previous contents were last read before a block barrier.
__device__ __forceinline__ void issue_weights(const Params& P, const Tile& T, int buf) {
    if (threadIdx.x < 32)
        issue_weights_w0(reinterpret_cast<bf16*>(smem + sm_w(P, buf)), T.w0, T.n0, T.w1, T.n1, T.K, buf);
}

__shared__ const bf16* s_xrow[MB];

// Copies nb input rows (pointers in s_xrow) of K elements into sX (pitch row_pitch(K)) with plain L2 loads (the
// inputs were written in this launch), four 16-byte loads in flight per thread; threads 0..NTHREADS-1 take part.
template <int NTHREADS = NT>
__device__ __forceinline__ void load_x(bf16* sX, int nb, int K, int pitch_elems = 0) {   // 0: row_pitch(K)
    const int per_row = K >> 3, n = nb * per_row, pitch = pitch_elems ? pitch_elems : row_pitch(K);
    for (int u0 = threadIdx.x; u0 < n; u0 += 4 * NTHREADS) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int u = u0 + j * NTHREADS;
            if (u < n) {
                const int b = u / per_row;
                v[j] = __ldcg(reinterpret_cast<const uint4*>(s_xrow[b]) + (u - b * per_row));
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int u = u0 + j * NTHREADS;
            if (u < n) {
                const int b = u / per_row;
                reinterpret_cast<uint4*>(sX + (size_t)b * pitch)[u - b * per_row] = v[j];
            }
        }
    }
}

// All threads: waits for the weights in buffer `buf`, then the block barrier that also publishes sX.
__device__ __forceinline__ void wait_weights(int buf) {
    mbar_wait(&s_wbar[buf], (unsigned)s_wphase[buf]);
    __syncthreads();
    if (threadIdx.x == 0) { s_wphase[buf] ^= 1; s_wpend[buf] = 0; }
    prof_mark(PS_LANDED);
}

// All threads: waits for every weight load still in flight (an aborted task, the end of the launch: no bulk copy
// may outlive the block).
__device__ __forceinline__ void drain_weights() {
    __syncthreads();
    for (int b = 0; b < 2; b++)
        if (s_wpend[b]) wait_weights(b);
    __syncthreads();
}

// One m16n8k16 bf16 MMA, fp32 accumulate: c += A B.
__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
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
    group_sync<NWC>();
    for (int i = threadIdx.x; i < R * nb; i += NWC * 32) {
        const int r = i / nb, b = i - r * nb, rb = r >> 4;
        float sum = 0.f;
        for (int ks = 0; ks < KS; ks++) sum += sRed[((size_t)(ks * RB + rb) * 16 + (r & 15)) * MB + b];
        sOut[r * MB + b] = sum;
    }
    group_sync<NWC>();
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

// ---- static GEMV tasks ---------------------------------------------------------------------------------------
__device__ __forceinline__ bool is_gemv_op(int op) {
    return op == OP_QKV || op == OP_OPROJ || op == OP_ROUTER || op == OP_MLP_GU || op == OP_MLP_DOWN || op == OP_LM_HEAD;
}

// The weight tile of a static GEMV record (op, layer, first row, rows) and, if wanted, where its input rows start.
__device__ __forceinline__ Tile static_tile(const Params& P, int op, int l, int r0, int nr, const bf16** xin = nullptr,
                                            int* xpitch = nullptr) {
    const int H = PI(H), Bm = PI(Bm), L = PI(L);
    const int Q = PI(n_heads) * PI(head_dim);
    const long long* wp = l < L ? layer_wptr(P, l) : nullptr;
    Tile T;
    T.w1 = nullptr;
    T.n1 = 0;
    T.n0 = nr;
    const bf16* x;
    int pitch = H;
    switch (op) {
        case OP_QKV:
            T.K = H; T.w0 = reinterpret_cast<const bf16*>(wp[WP_QKV]) + (size_t)r0 * H;
            x = PP(const bf16*, x) + (size_t)l * Bm * H;
            break;
        case OP_OPROJ:
            T.K = Q; T.w0 = reinterpret_cast<const bf16*>(wp[WP_O]) + (size_t)r0 * Q;
            x = PP(const bf16*, attn) + (size_t)l * Bm * Q; pitch = Q;
            break;
        case OP_ROUTER:
            T.K = H; T.w0 = reinterpret_cast<const bf16*>(wp[WP_ROUTER]) + (size_t)r0 * H;
            x = PP(const bf16*, x) + (size_t)l * Bm * H;
            break;
        case OP_MLP_GU: {
            const int width = layer_info(P, l)[LI_MLP_WIDTH];
            const bf16* w = reinterpret_cast<const bf16*>(wp[WP_MLP_GU]);
            T.K = H; T.w0 = w + (size_t)r0 * H; T.w1 = w + (size_t)(width + r0) * H; T.n1 = nr;
            x = PP(const bf16*, x) + (size_t)l * Bm * H;
            break;
        }
        case OP_MLP_DOWN: {
            const int width = layer_info(P, l)[LI_MLP_WIDTH];
            T.K = width; T.w0 = reinterpret_cast<const bf16*>(wp[WP_MLP_DOWN]) + (size_t)r0 * width;
            x = PP(const bf16*, mact) + (size_t)l * Bm * PI(I_mlp); pitch = PI(I_mlp);
            break;
        }
        default:  // OP_LM_HEAD
            T.K = H; T.w0 = PP(const bf16*, lm_head) + (size_t)r0 * H;
            x = PP(const bf16*, x) + (size_t)L * Bm * H;
            break;
    }
    if (xin) *xin = x;
    if (xpitch) *xpitch = pitch;
    return T;
}

// All threads: with two weight buffers, issue the tile of the block's next ticket into buffer `buf` if that task is a
// GEMV (its record is read here; the loop reads it again when it runs it) and record it in s_pf_ticket / s_pf_buf.
__device__ __forceinline__ void prefetch_next(const Params& P, int buf) {
    const int next = s_next;
    if (!PI(wbuf) || !PI(claim_ahead) || next >= PI(n_tasks)) return;   // (s_next is the next ticket only then)
    const int* r = PP(const int*, tasks) + (size_t)next * MK_REC_INTS;
    const int op = __ldg(r + RF_OP);
    if (!is_gemv_op(op)) return;
    const Tile T = static_tile(P, op, __ldg(r + RF_LAYER), __ldg(r + RF_A0), __ldg(r + RF_A1));
    if ((size_t)(T.n0 + T.n1) * row_pitch(T.K) * 2 > (size_t)PI(wbuf)) return;   // the plan keeps tiles in a buffer
    issue_weights(P, T, buf);
    if (threadIdx.x == 0) { s_pf_ticket = next; s_pf_buf = buf; }
}

// The O projection's rows r0..r0+nr of every row of the step (in sOut) plus the bias, into ao (a static OPROJ task
// and an O item of the expert queue share it).
__device__ __forceinline__ void oproj_epilogue(const Params& P, int l, int r0, int nr) {
    const int H = PI(H), B = PI(B);
    const float* sOut = reinterpret_cast<const float*>(smem + SM_OUT);
    const bf16* bias = reinterpret_cast<const bf16*>(layer_wptr(P, l)[WP_O_BIAS]);
    bf16* out = PP(bf16*, ao) + (size_t)l * PI(Bm) * H;
    for (int i = threadIdx.x; i < nr * B; i += NT) {
        const int r = i / B, b = i - r * B;
        float v = sOut[r * MB + b];
        if (bias) v += bf2f(bias[r0 + r]);
        out[(size_t)b * H + r0 + r] = f2bf(v);
    }
}

// ---- LM head ---------------------------------------------------------------------------------------------------
static_assert(MB <= NW, "the LM head keeps row b's running maximum in warp b");

// LM-head rows r0..r0+nr of every row of the step (in sOut): the scaled logits into `logits`, and each row's best
// (value, vocab index) folded into bv / bi of warp b for row b (every lane holds it). Ties go to the smaller index.
__device__ __forceinline__ void lm_epilogue(const Params& P, int r0, int nr, float& bv, int& bi) {
    const int V = PI(V), B = PI(B);
    const float scale = PF(logit_scale);
    float* lg = PP(float*, logits);
    float* sO = reinterpret_cast<float*>(smem + SM_OUT);
    for (int i = threadIdx.x; i < nr * B; i += NT) {
        const int r = i / B, b = i - r * B;
        const float v = rbf(rbf(sO[r * MB + b]) * scale);
        sO[r * MB + b] = v;
        lg[(size_t)b * V + r0 + r] = v;
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp < B) {
        float tv = -INFINITY;
        int ti = 0x7fffffff;
        for (int r = lane; r < nr; r += 32) {
            const float v = sO[r * MB + warp];
            if (v > tv || (v == tv && r0 + r < ti)) { tv = v; ti = r0 + r; }
        }
        warp_argmax(tv, ti);
        if (tv > bv || (tv == bv && ti < bi)) { bv = tv; bi = ti; }
    }
}

// Lane 0 of warp b: row b's maximum of LM-head task t.
__device__ __forceinline__ void lm_store_best(const Params& P, int t, float bv, int bi) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp < PI(B) && lane == 0) {
        float* best = PP(float*, lm_best) + ((size_t)t * PI(Bm) + warp) * 2;
        best[0] = bv;
        best[1] = (float)bi;
    }
}

// A FLAG_FUSED_NORM tile's input rows: every row's residual and norm (in sH) into sX, and with FLAG_WRITE_H /
// FLAG_WRITE_X the residual / normed rows to global memory for the tasks that read them. Not inlined: the vectorised
// residual's registers would spill in the persistent loop.
__device__ __noinline__ void fused_inputs(const Params& P, int l, int flags, bf16* sX, float* sH, int pitch) {
    const int H = PI(H), Bm = PI(Bm), B = PI(B);
    for (int b = 0; b < B; b++) {
        residual_row(P, l, b, sH);
        bf16* hdst = (flags & MK_FLAG_WRITE_H) ? PP(bf16*, h) + ((size_t)l * Bm + b) * H : nullptr;
        norm_row(P, l, sH, sH + H, sX + (size_t)b * pitch, hdst);
        if (flags & MK_FLAG_WRITE_X) {      // the same columns per thread as norm_row wrote: no barrier
            bf16* xg = PP(bf16*, x) + ((size_t)l * Bm + b) * H;
            const bf16* xs = sX + (size_t)b * pitch;
            for (int c = threadIdx.x; c < H / NORM_COLS_PER_THREAD; c += NT)
#pragma unroll
                for (int j = 0; j < NORM_COLS_PER_THREAD; j++)
                    xg[c * NORM_COLS_PER_THREAD + j] = xs[c * NORM_COLS_PER_THREAD + j];
        }
        __syncthreads();                    // sH is the next row's
    }
}

// Weights first (this task's, unless prefetched, then the next task's), then the waits, then the inputs, then the
// math and the task's epilogue. pf_buf: the buffer the previous task issued this task's weights into (-1: none).
__device__ bool task_gemv(const Params& P, const int* rec, int ticket, int pf_buf) {
    const int op = rec[RF_OP], l = rec[RF_LAYER], r0 = rec[RF_A0], nr = rec[RF_A1];
    const int H = PI(H), Bm = PI(Bm), B = PI(B), L = PI(L);
    const int Q = PI(n_heads) * PI(head_dim);
    const long long* wp = l < L ? layer_wptr(P, l) : nullptr;
    const int* li = l < L ? layer_info(P, l) : nullptr;
    const bf16* xin;
    int xpitch;
    const Tile T = static_tile(P, op, l, r0, nr, &xin, &xpitch);
    const int flags = rec[RF_FLAGS];
    const bool fused = (flags & MK_FLAG_FUSED_NORM) != 0;      // QKV / ROUTER / MLP_GU only: K == H
    const int R = T.n0 + T.n1;
    const size_t x_end = sm_x_end(P, R, T.K, B);
    if (!smem_fits(P, x_end + (fused ? (size_t)(H + NW) * 4 : 0), ticket)) { drain_weights(); return false; }
    int buf = 0;
    if (pf_buf >= 0) {
        buf = pf_buf;                        // issued by the previous task: `issued` stays at the claim
    } else {
        issue_weights(P, T, buf);
        prof_mark(PS_ISSUED);
    }
    prefetch_next(P, buf ^ 1);
    if (!fused && threadIdx.x < B) s_xrow[threadIdx.x] = xin + (size_t)threadIdx.x * xpitch;
    if (!wait_rec(P, rec, ticket)) { drain_weights(); return false; }
    if (fused) {       // the rows' residual and norm straight into sX (the weights keep landing meanwhile)
        fused_inputs(P, l, flags, reinterpret_cast<bf16*>(smem + sm_x(P, R, T.K)),
                     reinterpret_cast<float*>(smem + x_end), row_pitch(T.K));
    } else {
        load_x(reinterpret_cast<bf16*>(smem + sm_x(P, R, T.K)), B, T.K);
    }
    wait_weights(buf);
    gemv(P, buf, R, T.K, B);
    const float* sOut = reinterpret_cast<const float*>(smem + SM_OUT);
    switch (op) {
        case OP_QKV: {
            const int d = PI(head_dim), KVs = PI(n_kv) * d;
            const bf16* bias = reinterpret_cast<const bf16*>(wp[WP_QKV_BIAS]);
            const int region = r0 < Q ? 0 : (r0 < Q + KVs ? 1 : 2);
            const int rel = r0 - (region == 0 ? 0 : (region == 1 ? Q : Q + KVs));
            const int head = rel / d, dd0 = rel % d;
            const bool rope = li[LI_USES_ROPE] && region < 2;
            const float* inv_freq = PP(const float*, inv_freq);
            const int* pos = step_in(P) + Bm;
            for (int i = threadIdx.x; i < (nr / 2) * B; i += NT) {
                const int pr = i / B, b = i - pr * B, r = 2 * pr;
                float v0 = sOut[r * MB + b], v1 = sOut[(r + 1) * MB + b];
                if (bias) { v0 += bf2f(bias[r0 + r]); v1 += bf2f(bias[r0 + r + 1]); }
                v0 = rbf(v0); v1 = rbf(v1);
                if (rope) {
                    const float ang = (float)pos[b] * inv_freq[(dd0 + r) >> 1];
                    const float c = rbf(cosf(ang)), s = rbf(sinf(ang));
                    const float o0 = v0 * c + (-v1) * s;
                    const float o1 = v1 * c + v0 * s;
                    v0 = o0; v1 = o1;
                }
                bf16* dst;
                if (region == 0) {
                    dst = PP(bf16*, q) + ((size_t)l * Bm + b) * Q + r0 + r;
                } else {
                    dst = kv_slot(P, li[LI_GROUP], li[LI_LIG], b, pos[b]) + (region == 2 ? (size_t)PI(block_size) * KVs : 0)
                          + head * d + dd0 + r;
                }
                dst[0] = f2bf(v0);
                dst[1] = f2bf(v1);
            }
            break;
        }
        case OP_OPROJ:
            oproj_epilogue(P, l, r0, nr);
            break;
        case OP_ROUTER: {
            const int E = PI(E);
            float* out = PP(float*, rlog) + (size_t)li[LI_MOE_IDX] * Bm * E;
            for (int i = threadIdx.x; i < nr * B; i += NT) {
                const int r = i / B, b = i - r * B;
                out[(size_t)b * E + r0 + r] = rbf(sOut[r * MB + b]);
            }
            break;
        }
        case OP_MLP_GU: {
            const int pitch = PI(I_mlp);
            bf16* out = PP(bf16*, mact) + (size_t)l * Bm * pitch;
            for (int i = threadIdx.x; i < nr * B; i += NT) {
                const int r = i / B, b = i - r * B;
                const float g = rbf(sOut[r * MB + b]), u = rbf(sOut[(nr + r) * MB + b]);
                out[(size_t)b * pitch + r0 + r] = f2bf(rbf(g / (1.f + expf(-g))) * u);
            }
            break;
        }
        case OP_MLP_DOWN: {
            bf16* out = PP(bf16*, mout) + (size_t)l * Bm * H;
            for (int i = threadIdx.x; i < nr * B; i += NT) {
                const int r = i / B, b = i - r * B;
                out[(size_t)b * H + r0 + r] = f2bf(sOut[r * MB + b]);
            }
            break;
        }
        default: {  // OP_LM_HEAD (one tile): logits and the tile's argmax per row
            float bv = -INFINITY;
            int bi = 0x7fffffff;
            lm_epilogue(P, r0, nr, bv, bi);
            lm_store_best(P, rec[RF_A2], bv, bi);
            break;
        }
    }
    task_signal(P, rec[RF_SIG]);
    return true;
}
