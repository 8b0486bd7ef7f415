// Two of an attention split's shared-memory layouts, padded (MK_ATTN_PAD=1) or not (0), and its cp.async group
// accounting. Self-contained (host and device, no kernel parameters): the kernel, benchmarks/attn_stream.cu and a CPU
// test (tests/kernel/test_attn_layout.py) use these functions, so the test checks the code the kernel runs.
//
// Q, [gq][d + QPAD] bf16 (QPAD: opcodes.ATTN_ROW_PAD elements, as K's and V's rows have). Every chunk of every split,
// each computing warp reads its MMA A fragments from Q as 32-bit words (row g = lane / 4, word ks * 8 + lane % 4, and
// 4 words further), all 8 rows at once. Unpadded, rows d * 2 bytes apart (256 at head_dim 128, a multiple of the 128
// bytes the 32 banks span) put the 8 rows' words in one bank: an 8-way conflict on each of the 2 * d / 16 loads per
// warp per chunk (at head_dim 128 and 16 computing warps ~2050 of a chunk's ~3300 shared-memory wavefronts). 16
// bytes more per row move each row 4 banks on: one wavefront per load at every head_dim task_attn instantiates.
//
// The merge, [ATTN_WARPS][gq][d + MPAD] fp32 (MPAD: opcodes.ATTN_MERGE_PAD floats): after its last chunk each
// computing warp stores its output accumulators there, lane (g, t) a float2 at row g, column 2t + 8n. Unpadded rows
// (512 bytes apart at head_dim 128) put each half-warp's 4 rows in the same 8 banks: 4 wavefronts per half where 1
// does; 32 bytes more per row move each row 8 banks on.
#pragma once
#include <stddef.h>

#if defined(__CUDACC__)
#define MK_HD __host__ __device__
#else
#define MK_HD
#endif

// Elements from one of Q's rows to the next.
template <int D, int QPAD>
MK_HD constexpr int q_pitch() {
    static_assert(QPAD % 8 == 0, "Q's rows stay 16-byte aligned (the copies' destinations)");
    return D + QPAD;
}

// The 16-byte chunk of Q's shared memory that holds row r's chunk j (the 16-byte copies' destination).
template <int D, int QPAD>
MK_HD constexpr int q_chunk(int r, int j) {
    return r * (q_pitch<D, QPAD>() / 8) + j;
}

// The 32-bit word of Q's shared memory that holds row r's word w (elements 2w, 2w + 1): the register stores and the
// A fragments' reads.
template <int D, int QPAD>
MK_HD constexpr int q_word(int r, int w) {
    return r * (q_pitch<D, QPAD>() / 2) + w;
}

// Floats from one of the merge's rows (one warp's outputs of one query head) to the next.
template <int D, int MPAD>
MK_HD constexpr int merge_pitch() {
    static_assert(MPAD % 2 == 0, "the rows' float2 stores stay 8-byte aligned");
    return D + MPAD;
}

// The float of the merge that holds row r's output column c.
template <int D, int MPAD>
MK_HD constexpr size_t merge_float(size_t r, int c) {
    return r * merge_pitch<D, MPAD>() + c;
}

// The cp.async groups a thread of a split may leave in flight once chunk c must have landed (the 16-byte copy path):
// its groups in commit order are the n_before_q chunks issued ahead of Q's rows, Q's group (q_async), then the later
// chunks, n_issued chunks in all so far. Chunk c's group and every older one must be complete, and at c == 0 Q's
// too. (n_issued - c - 1, the chunks after c, is enough wherever Q's group follows chunk 0 alone: a ring of two.)
MK_HD constexpr int attn_pending_groups(int c, int n_issued, int n_before_q, bool q_async) {
    return q_async && c == 0 && n_issued - n_before_q < n_issued - c - 1 ? n_issued - n_before_q : n_issued - c - 1;
}
