// Where an attention split keeps Q in shared memory: [gq][d + PAD] bf16, PAD elements after each row (MK_ATTN_Q_PAD=1:
// opcodes.ATTN_ROW_PAD, as K's and V's rows have; 0: none). Self-contained (host and device, no kernel parameters): the
// kernel, benchmarks/attn_stream.cu and a CPU test (tests/kernel/test_attn_q_layout.py) use these functions.
//
// Why: every chunk of every split, each computing warp reads its MMA A fragments from Q as 32-bit words (row g = lane
// / 4, word ks * 8 + lane % 4, and 4 words further), all 8 rows at once. Unpadded, rows d * 2 bytes apart (256 at
// head_dim 128, a multiple of the 128 bytes the 32 banks span) put the 8 rows' words in one bank: an 8-way conflict on
// each of the 2 * d / 16 loads per warp per chunk (at head_dim 128 and 16 computing warps ~2050 of a chunk's ~3300
// shared-memory wavefronts). 16 bytes more per row move each row 4 banks on: one wavefront per load at every head_dim
// task_attn instantiates, with the addresses still a base plus constants.
#pragma once

#if defined(__CUDACC__)
#define MK_HD __host__ __device__
#else
#define MK_HD
#endif

// Elements from one of Q's rows to the next.
template <int D, int PAD>
MK_HD constexpr int q_pitch() {
    static_assert(PAD % 8 == 0, "rows stay 16-byte aligned (the copies' destinations)");
    return D + PAD;
}

// The 16-byte chunk of Q's shared memory that holds row r's chunk j (the 16-byte copies' destination).
template <int D, int PAD>
MK_HD constexpr int q_chunk(int r, int j) {
    return r * (q_pitch<D, PAD>() / 8) + j;
}

// The 32-bit word of Q's shared memory that holds row r's word w (elements 2w, 2w + 1): the register stores and the
// A fragments' reads.
template <int D, int PAD>
MK_HD constexpr int q_word(int r, int w) {
    return r * (q_pitch<D, PAD>() / 2) + w;
}

// Q's bytes for gq rows.
template <int D, int PAD>
MK_HD constexpr int q_bytes(int gq) {
    return gq * q_pitch<D, PAD>() * 2;
}
