// The GEMV weight loader: the shared-memory layouts of a weight tile and its input rows, the weight buffers'
// bulk copies (TMA) and mbarriers, the input rows' loads. mk_gemv_core.cuh multiplies what it lands.
#pragma once
#include "mk_common.cuh"

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

// Weight loads are bulk copies (TMA) completing on the buffer's mbarriers: the tile's rows in nch <= MK_MAX_WCHUNKS
// chunks of wchunk_rows(R, nch) rows (the plan's `wchunks`; the last chunks may be short or empty), chunk c of buffer
// b on s_wbar[2 * c + b] (so s_wbar[b] is chunk 0: paths that land a whole tile there arm the other chunks empty), one copy per chunk and tile half
// (contiguous rows), or with ROW_PAD one per row, spread over the lanes of the issuing warp. No thread stalls issuing
// thousands of 16-byte copies, so a prefetch costs the block nothing while the current tile still lands. Every fill
// arms every chunk once, so all of a buffer's chunks share one phase: s_wphase[b], the parity the next completion
// will have; s_wpend[b]: a load into b is in flight (not yet waited for and consumed).
__shared__ __align__(8) unsigned long long s_wbar[2 * MK_MAX_WCHUNKS];
__shared__ int s_wphase[2], s_wpend[2];

// Thread 0, once per launch before the first barrier.
__device__ __forceinline__ void init_weight_buffers() {
    for (int i = 0; i < 2 * MK_MAX_WCHUNKS; i++) mbar_init(&s_wbar[i], 1);
    for (int b = 0; b < 2; b++) { s_wphase[b] = 0; s_wpend[b] = 0; }
    fence_mbar_init();
}

// Rows per landing chunk of an R-row tile in nch chunks (the issuer and the cores' WaitRows agree through this).
__device__ __forceinline__ int wchunk_rows(int R, int nch) { return max(1, (R + nch - 1) / nch); }

// One thread, for a fill that lands the whole tile on chunk 0 (s_wbar[buf]): chunks 1.. of buf arrive with nothing
// to land, so every chunk's phase moves once per fill.
__device__ __forceinline__ void arm_empty_chunks(int buf) {
    for (int c = 1; c < MK_MAX_WCHUNKS; c++) mbar_arrive(&s_wbar[2 * c + buf]);
}

// One warp: lane 0 arms the chunks' mbarriers with their bytes, then the lanes issue the copies. nch: the tile's
// chunks (1: every row on chunk 0, as the warp-specialised worker, which waits on s_wbar[buf] alone, needs).
__device__ __noinline__ void issue_weights_w0(bf16* sW, const bf16* w0, int n0, const bf16* w1, int n1, int K, int buf,
                                              int nch) {
    const int lane = threadIdx.x & 31;
    const unsigned row_bytes = (unsigned)K * 2;
    const int R = n0 + n1, rc = wchunk_rows(R, nch);
    if (lane == 0) {
        s_wpend[buf] = 1;                    // before the arrive: its release publishes the flag with the meta
        fence_proxy_async();                 // earlier generic reads/writes of this memory before the async writes
        for (int c = 0; c < MK_MAX_WCHUNKS; c++) {
            const int a = min(R, c * rc), b = min(R, a + rc);
            mbar_expect_tx(&s_wbar[2 * c + buf], row_bytes * (unsigned)(b - a));   // (0 bytes: a plain arrive)
        }
    }
    __syncwarp();
    fence_proxy_async();
    const unsigned long long pol = l2_evict_first();
#if MK_ROW_PAD
    const int pitch = row_pitch(K);
    for (int r = lane; r < R; r += 32) {
        const bf16* src = r < n0 ? w0 + (size_t)r * K : w1 + (size_t)(r - n0) * K;
        bulk_load(sW + (size_t)r * pitch, src, row_bytes, &s_wbar[2 * (r / rc) + buf], pol);
    }
#else                                        // contiguous rows: per chunk, one copy per tile half it covers
    if (lane < nch) {
        const int a = min(R, lane * rc), b = min(R, a + rc);
        unsigned long long* bar = &s_wbar[2 * lane + buf];
        if (a < min(b, n0)) bulk_load(sW + (size_t)a * K, w0 + (size_t)a * K, row_bytes * (min(b, n0) - a), bar, pol);
        const int a1 = max(a, n0);
        if (a1 < b) bulk_load(sW + (size_t)a1 * K, w1 + (size_t)(a1 - n0) * K, row_bytes * (b - a1), bar, pol);
    }
#endif
}

// Starts the copy of the tile's weights into weight buffer `buf` (immutable: safe before any wait). All threads call
// it (uniformly); warp 0 issues. The buffer's previous contents were last read before a block barrier.
__device__ __forceinline__ void issue_weights(const Params& P, const Tile& T, int buf) {
    if (threadIdx.x < 32)
        issue_weights_w0(reinterpret_cast<bf16*>(smem + sm_w(P, buf)), T.w0, T.n0, T.w1, T.n1, T.K, buf, PI(wchunks));
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

// All threads: waits for the weights in buffer `buf` (every chunk), then the block barrier that also publishes sX.
__device__ __forceinline__ void wait_weights(int buf) {
    for (int c = 0; c < MK_MAX_WCHUNKS; c++) mbar_wait(&s_wbar[2 * c + buf], (unsigned)s_wphase[buf]);
    __syncthreads();
    if (threadIdx.x == 0) { s_wphase[buf] ^= 1; s_wpend[buf] = 0; }
    prof_mark(PS_LANDED);
}

// The chunked landing of one weight buffer, as the GEMV cores see it: before a warp reads rows r0..r1 it waits for
// the chunks that hold them (a chunk's mbarrier completing makes its bulk copies' bytes visible to the waiting
// thread). bar == nullptr: the tile has landed already (wait_weights).
struct WaitRows {
    unsigned long long* bar;                 // chunk 0 of the buffer; chunk c at bar + 2 * c
    unsigned parity;
    int rc;                                  // rows per chunk (wchunk_rows)
    __device__ __forceinline__ void rows(int r0, int r1) const {
        if (bar == nullptr) return;
        for (int c = r0 / rc; c <= r1 / rc; c++) mbar_wait(bar + 2 * c, parity);
    }
};

// All threads, instead of wait_weights where a core of gemv() reads the tile: the block barrier that publishes sX,
// and the WaitRows its core waits on. weights_consumed(buf) after the core's closing barrier (by then every chunk
// holding a row has been waited for by some warp; an empty chunk completed at its arming).
__device__ __forceinline__ WaitRows weights_by_rows(const Params& P, int buf, int R) {
    __syncthreads();
    prof_mark(PS_LANDED);                    // (here: the inputs are published; the rows land under the math)
    return WaitRows{&s_wbar[buf], (unsigned)s_wphase[buf], wchunk_rows(R, PI(wchunks))};
}
__device__ __forceinline__ void weights_consumed(int buf) {
    if (threadIdx.x == 0) { s_wphase[buf] ^= 1; s_wpend[buf] = 0; }
}

// All threads: waits for every weight load still in flight (an aborted task, the end of the launch: no bulk copy
// may outlive the block).
__device__ __forceinline__ void drain_weights() {
    __syncthreads();
    for (int b = 0; b < 2; b++)
        if (s_wpend[b]) wait_weights(b);
    __syncthreads();
}
