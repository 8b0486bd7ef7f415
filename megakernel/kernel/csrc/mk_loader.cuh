// The GEMV weight loader: the shared-memory layouts of a weight tile and its input rows, the weight buffers'
// bulk copies (TMA) and mbarriers, the input rows' loads. mk_gemv_core.cuh multiplies what it lands.
#pragma once
#include "mk_common.cuh"

// ---- GEMV: a tile of weight rows (staged in shared memory) times up to MB input rows ---------------------------
// Layouts (plan.smem_bytes sizes both; every weight and input row is padded to a pitch of K + ROW_PAD elements):
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

// MK_LOADX_ASYNC: load_x by 16-byte cp.async, every copy of a thread in flight at once (1, the default since session
// 29), or four L2 loads in flight per thread through registers (0). At 16 rows the O projection's input is 16 x 4096
// bf16 = 128 KB: 8192 16-byte pieces, four rounds of L2 round trips at 0 (two at 8 rows), one at 1. The b16 trace
// (session 28, H100) had 8.5 us of each O tile's 14.2 waiting on its loads (64 KB of weights and those 128 KB of
// inputs). Measured (session 29, H100, own processes): b16 -2.3%, b8 -1.3%, b1 even.
#ifndef MK_LOADX_ASYNC
#define MK_LOADX_ASYNC 1
#endif

// Copies nb input rows (pointers in s_xrow) of K elements into sX (pitch row_pitch(K)) from L2 (the inputs were
// written in this launch; .cg, never the incoherent L1 / nc path); threads 0..NTHREADS-1 take part, and each has
// its own copies landed when it returns (the caller's barrier publishes them).
template <int NTHREADS = NT>
__device__ __forceinline__ void load_x(bf16* sX, int nb, int K, int pitch_elems = 0) {   // 0: row_pitch(K)
    const int per_row = K >> 3, n = nb * per_row, pitch = pitch_elems ? pitch_elems : row_pitch(K);
#if MK_LOADX_ASYNC
    // piece u = threadIdx.x + i * NTHREADS is row b, 16-byte column c: both stepped, no division per piece
    int b = 0, c = threadIdx.x;
    while (c >= per_row && b < nb) { c -= per_row; b++; }
    for (int u = threadIdx.x; u < n; u += NTHREADS) {
        cp_async16(sX + (size_t)b * pitch + c * 8, reinterpret_cast<const uint4*>(s_xrow[b]) + c);
        c += NTHREADS;
        while (c >= per_row) { c -= per_row; b++; }
    }
    cp_async_commit();
    cp_async_wait_all();
#else
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
#endif
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
