// Helpers of the decode megakernel: bf16 conversions, async copies, acquire/release counters, watchdog waits.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <cstdio>      // (device printf: MK_STALL_PRINT's reports; some toolkits' headers do not bring it in)
#include "mk_generated.h"
#include "mk_math.cuh"
#include "mk_async.cuh"

typedef __nv_bfloat16 bf16;

// The profiling build (-DMK_PROFILE=1) stamps every task; the normal build compiles every stamp away.
#ifndef MK_PROFILE
#define MK_PROFILE 0
#endif
// (MK_SIGNAL_FENCE, removed in session 26: a __threadfence() before each counter release. The release after the
// block or warp barrier publishes what that barrier ordered (a gpu-scope release is cumulative), and each fence waited
// for every copy in flight on its SM: without it b1 8K -1.3%, b8 -0.9%, b16 -0.8%, 933582e; SPEED_NOTES, session 20.)
// MK_GEMV_TC: the GEMV core on tensor cores for launches of more than one row (1), or on CUDA cores always (0);
// mk_gemv_core.cuh.
#ifndef MK_GEMV_TC
#define MK_GEMV_TC 1
#endif
// MK_GEMV_B1: the GEMV core at one input row with x's slice in registers and every weight load of a row in flight
// (1, mk_gemv_core.cuh gemv_core_b1), or the CUDA-core loop of every batch size (0). On: measured b1 8K 3.94 vs 4.12 ms,
// b8 14.78 vs 15.47 (separate processes, e74180e; SPEED_NOTES.md, 2026-12-01 fifth session). (A software-pipelined
// variant lost: SPEED_NOTES.md, tenth session.)
#ifndef MK_GEMV_B1
#define MK_GEMV_B1 1
#endif
// MK_SMALL_VEC: the single-block tasks on every layer's critical path with all of a thread's L2 loads in flight
// together (1): NORM's residual add and norm with 8 columns per thread and 16-byte loads (mk_norm.cuh), the
// attention combine reading each split's log-sum-exp once and 16 splits' partial outputs at a time
// (mk_attention.cuh); or the loops that chain them (0). The same per-element math either way. On: measured b1 8K
// 4.85 vs 5.08 ms, b8 16.03 vs 16.33 (SPEED_NOTES.md, 2026-12-01 night).
// 2: as 1, and NORM issues all of a thread's loads (h, attention, MLP, the experts' outputs, its norm weights)
// at once and normalises in registers (one L2 round trip instead of three or four). 2 is the default: with
// the packed TOPK measured b1 8K 3.82 vs 3.92 ms, b8 14.66 vs 14.66 (separate processes, 7c5f6f7; SPEED_NOTES.md).
// 3: as 2, and the attention combine of up to 16 splits issues its partials' loads with its log-sum-exps' (one L2
// round trip where it waits for two; a round trip costs ~3 us under the experts' load). Off until it has run on
// the GPU.
#ifndef MK_SMALL_VEC
#define MK_SMALL_VEC 2
#endif
// MK_MOE_LOCAL: the plain MoE worker reads its layer's routing (every slot's expert, first pair and count, every
// pair's row) into shared memory once, in the same round trip as the queue's header, instead of from L2 for every
// item; a down item's pair weights and ranks are loaded with its inputs; consecutive items with the same inputs in
// the same place load them once (1), or the per-item L2 reads (0). On: measured b1 8K 3.90 vs 3.93 ms, b8 14.43 vs
// 14.72 (separate processes, e74180e; SPEED_NOTES.md, 2026-12-01 fifth session).
#ifndef MK_MOE_LOCAL
#define MK_MOE_LOCAL 1
#endif

// (MK_TOPK_PACKED, removed in the fourteenth session: TOPK's one 32-bit warp max per round, the bf16 logit's 16-bit
// order-preserving key above 0xffff - expert, is the only selection; its ballot-per-word alternative measured
// slower (b1 8K 3.82 vs 3.92 ms, 7c5f6f7) and its build kept tipping the persistent loop into spills.)

// (MK_SWZ and MK_SWZ_3D, removed in session 26: the plain MoE worker's expert tiles by swizzled tensor copies on the
// tensor-core core of csrc/mk_gemv_swz.cuh measured slower at b1 and b8 in sessions 6-7, and the paged worker has run
// every MoE item of up to 16 rows since; benchmarks/gemv_stream.cu still times that core alone.)
// MK_ATTN_BULK: how attention's K/V chunks reach shared memory: 16-byte cp.async from every thread (0); one bulk copy
// (TMA) per 256-byte K or V row, on an mbarrier per ring stage (1); tensor copies of 16 keys x one kv head through
// the host's maps of the KV pools, swizzled, where head_dim is 64 or 128 and KV blocks a multiple of 16 keys (2).
// Session 25 (dynamic shared memory 128-byte aligned since session 24), against 0: 1 gives b1 8K -0.1%, b1 128K -0.2%,
// b8 8K -3.8%; 2 gives -0.3%, +2.1%, -4.8% (and spills 12 bytes beside MK_EARLY_TABLES=1). Session 27 (H100, each
// build in its own process): 1 alone b1 8K +0.9%, 128K +1.5%, b8 -2.9%, b16 -1.1%; with MK_ATTN_PAD, MK_ATTN_ISSUE and
// MK_ATTN_MATH (the default since) -2.0%, -9.8%, -5.7%, -3.2% against 0 with the three off.
#ifndef MK_ATTN_BULK
#define MK_ATTN_BULK 1
#endif

// MK_ATTN_DSPLIT: the build has attention's second variant, the P V accumulators split over two warps per 16-key slice
// (each half the head dims, both computing the slice's scores), which launches of few rows select (the param
// attn_dsplit, ModelPlan.attn_dsplit_rows): a computing warp holds 16 accumulators at head_dim 128 instead of 32 and
// does not spill (one warp per slice spills 60-92 bytes per thread there). 0: one warp per slice only. (build.py
// turns it off in MK_MOE_LOCAL=0 builds unless asked: their persistent loop spills 24 bytes beside it.)
#ifndef MK_ATTN_DSPLIT
#define MK_ATTN_DSPLIT 1
#endif

// MK_ATTN_TABLE: attention's 16-byte cp.async path (MK_ATTN_BULK=0) reads a split's block-table entries into shared
// memory once, before its dependency wait, as the bulk paths do, instead of kv_slot's table load in front of every
// KV block segment of every chunk (b1 8K -1.0%, 128K -2.9%, b8 -1.9%, b16 -2.8%: each build in its own process,
// a74f391). 0: the per-segment lookups.
#ifndef MK_ATTN_TABLE
#define MK_ATTN_TABLE 1
#endif

// MK_ATTN_Q_ASYNC: attention's cp.async path copies its Q rows as a cp.async group of their own after its dependency
// wait, instead of loading them into registers and storing them: the store waited for the load's L2 round trip, and
// the chunk loop's first issue came after it, so the SM had nothing in flight for that round trip (a SASS audit,
// session 24: ~0.6-1 us per split). 0: the register load, as before. 2: the bulk-copy paths (MK_ATTN_BULK >= 1) copy Q
// by cp.async too (at 1 they load it into registers: the same wait in front of the loop's first issue).
#ifndef MK_ATTN_Q_ASYNC
#define MK_ATTN_Q_ASYNC 1
#endif

// MK_ATTN_ISSUE: which threads issue an attention chunk's bulk copies (MK_ATTN_BULK=1), where a warp's copies go out
// one lane at a time (~41 cycles each): 1 spreads them so no warp issues more than 16 (the two-warp variant, b1-b2),
// or has the warps that do not compute issue them (the one-warp variant, b3-b16), and drops the block barrier
// between a chunk's wait and its math after the first chunk, so the computing warps wait and compute while the
// others issue; 0: threads 0..255, and every warp meets after each wait. Session 27 (H100, beside MK_ATTN_BULK=1 and
// MK_ATTN_PAD=1): b1 8K -0.1%, 128K -1.3%, b8 -0.9%, b16 -1.0%. The default since.
#ifndef MK_ATTN_ISSUE
#define MK_ATTN_ISSUE 1
#endif

// MK_ATTN_PAD: an attention split's Q rows (ATTN_ROW_PAD elements, as K's and V's) and its merge's fp32 rows
// (ATTN_MERGE_PAD floats) padded in shared memory (1; mk_attn_layout.cuh), or not (0). Unpadded, rows 256 bytes apart
// at head_dim 128 put a warp's 8 rows of Q fragment words in one bank: an 8-way conflict on each of a warp's 16 Q
// loads per chunk, most of the chunk's shared-memory wavefronts (at 16 computing warps ~2050 of ~3300, with K's 512,
// V's 256 and the copies' 512); the merge's output stores, once per split, 4 wavefronts per half-warp where 1 does.
// attn_stream.cu: the two-warp math adds 1.06 us per 64 KB chunk to the copies' 2.0 and the one-warp math 0.39,
// about in the ratio of their Q loads; the b1 trace's math is 2.0 us per chunk. Session 27 (H100, beside
// MK_ATTN_BULK=1): b1 8K -2.0%, 128K -8.9%, b8 -1.5%, b16 -1.2%. The default since.
#ifndef MK_ATTN_PAD
#define MK_ATTN_PAD 1
#endif

// MK_ATTN_MATH: an attention chunk's math restructured (1; mk_attn_math.cuh, from session 26's SASS audit) on the
// padded-row paths: K's fragments by ldmatrix (one x4 per k-step instead of four 32-bit loads), Q K^T unrolled by 4,
// and ex2.approx with log2(e) in the scale instead of expf. Meant beside MK_ATTN_BULK=1, MK_ATTN_PAD=1,
// MK_ATTN_ISSUE=1, where neither head_dim-128 variant spills (that build's one-warp variant spills 12 bytes without
// it); on the cp.async path without the padding (MK_ATTN_BULK=0, MK_ATTN_PAD=0) the one-warp variant spills more
// with it (40 bytes, 20 without). 0: the math as measured through session 25. Session 27 (H100, beside the
// three): b1 8K -0.6%, 128K -1.1%, b8 -0.4%, b16 even. The default since.
#ifndef MK_ATTN_MATH
#define MK_ATTN_MATH 1
#endif

// MK_ATTN_STATS=1 (with MK_PROFILE, a diagnostic build): an attention split's four marks hold sums over its chunks,
// in ns, instead of stamps: m0 thread 0's wait for each chunk's copies (and the barrier after it), m1 the chunk's math
// (to the barrier that ends it), m2 issuing the next chunk's copies, m3 the chunk count (benchmarks/attn_stats.py
// reads them). In the step a 64 KB chunk takes ~4.5 us where attn_stream.cu's copies alone take 2.0 and its math 0.4
// (SPEED_NOTES, twentieth session): these sums say which part grows in the step. (In the profiling build, which
// spills anyway, the one-warp-per-slice variant at head_dim 128 then spills 32 bytes instead of 8; the b1-b2 variant
// none.) Under MK_ATTN_ISSUE=1 (bulk path) m0 is thread 0's own wait after chunk 0 (no barrier follows it), and m2 is
// thread 0's share of the issue: its 16 lanes' copies in the two-warp variant, only the counters and pad rows in the
// one-warp variant, whose copies other warps issue; their time shows in m1 where it outlasts the math.
#ifndef MK_ATTN_STATS
#define MK_ATTN_STATS 0
#endif
#define ATTN_STATS (MK_PROFILE && MK_ATTN_STATS)

// MK_EARLY_TABLES: loads a SASS audit (session 23) found issued a round trip later than they need be, moved up (1):
// the persistent loop's task record with its abort-flag read (two serial round trips per task before: thread 0 stored
// the flag before its warp's other lanes issued the record's loads), and the MoE worker's O-projection weights and
// bias with the experts' addresses before the route read (the bias was read after it, on the routing -> first page
// path, and each O item read the weights' address from the layer table between items), prefetch_next's record
// fields in one load with the op (three serial round trips before the next GEMV's tile was issued: two), and an
// attention split's layer info, position and block-table offsets in one wave (four serial round trips before its
// first copy: two, the second the block table's; session 24). 0: as before.
// MK_FUSED_TABLES_EARLY: a fused router / QKV tile reads its norm's tables (mk_norm.cuh norm_tables) before its
// dependency wait into registers (1), or after it (0). Session 33 (call 4, H100, own processes): b1 8K -0.25%, 1K
// -0.15%, b8 / b16 +0.1% (no fused tiles there); the rows still arrive ~3.5 us after the wait. Off
#ifndef MK_FUSED_TABLES_EARLY
#define MK_FUSED_TABLES_EARLY 0
#endif
#ifndef MK_EARLY_TABLES
#define MK_EARLY_TABLES 1
#endif

// MK_REPEAT_SMALL: an experiment, not a speed-up. The NORM, TOPK and attention-combine tasks run their (idempotent)
// work this many times before they signal: the second run finds the task's code in the SM's instruction cache, so a trace of the build
// with 2 against the default's 1 measures how much of a single-block task's ~5-10 us is its first, cold pass.
#ifndef MK_REPEAT_SMALL
#define MK_REPEAT_SMALL 1
#endif

struct Params {
    long long v[MK_NUM_PARAMS];
};

// The kernel reads its parameters from __constant__ memory, which mk_launch fills before each launch on the launch's
// stream, not from the kernel parameter. The task functions that are not inlined take `const Params&`, and there a
// parameter read is a generic load through L1; every acquire load of a counter (ld.acquire.gpu) invalidates the SM's
// L1, so after a dependency wait each dependent level of parameter reads was an L2 round trip (a router tile's fused
// norm had two such levels before its data loads). Constant-cache reads survive the invalidation: b1 8K -6.1%, 128K
// -9.5%, b8 -4.8% (SPEED_NOTES, session 17; the kernel-parameter reads were MK_CONST_PARAMS=0, removed in session 26).
// (`P` is still every task function's first argument, unread: taking it out is a separate change of every signature.)
__constant__ long long c_params[MK_NUM_PARAMS];
// Each read an opaque `ld.const` (ptxas still turns it into a constant-bank operand): read as c_params[i], the
// compiler hoisted parameter products and sign extensions out of the persistent loop into registers for the whole
// kernel, and the loop spilled them (32 B in the default build, more in switch builds).
template <int I>
__device__ __forceinline__ long long mk_param() {
    long long v;
    asm volatile("ld.const.u64 %0, [c_params+%1];" : "=l"(v) : "n"(I * 8));
    return v;
}
#define MK_PV(i) (mk_param<(i)>())
#define PI(name) ((int)MK_PV(PRM_##name))
#define PL(name) (MK_PV(PRM_##name))
#define PP(type, name) (reinterpret_cast<type>(MK_PV(PRM_##name)))
#define PF(name) (__int_as_float((int)MK_PV(PRM_##name)))

__device__ __forceinline__ float bf2f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 f2bf(float x) { return __float2bfloat16_rn(x); }
// Round an fp32 value to bf16 precision (what storing a PyTorch bf16 intermediate does).
__device__ __forceinline__ float rbf(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Loads of data produced inside this launch go to L2 (.cg), never through the incoherent L1 / nc path.
__device__ __forceinline__ float ldcg_bf(const bf16* p) {
    unsigned short u = __ldcg(reinterpret_cast<const unsigned short*>(p));
    return __uint_as_float(((unsigned)u) << 16);
}
__device__ __forceinline__ float ldcg_f(const float* p) { return __ldcg(p); }
__device__ __forceinline__ int ldcg_i(const int* p) { return __ldcg(p); }

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gsrc) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gsrc) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// ---- bulk copies (TMA) completing on an mbarrier: mk_async.cuh --------------------------------------------

__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int ld_volatile(const int* p) { return *((volatile const int*)p); }
// Plain (weak) loads issued where they are written: volatile asm is neither sunk below a branch nor merged, so loads
// meant to go out together do (ptxas moved attention's layer-info loads below its smem_fits exit, a round trip
// later: a SASS audit, session 24). Same memory semantics as a C++ load.
__device__ __forceinline__ int ld_now(const int* p) {
    int v;
    asm volatile("ld.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ int4 ld_now_v4(const int* p) {   // p 16-byte aligned
    int4 v;
    asm volatile("ld.global.v4.s32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ void red_release(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;\n" : "=l"(t));
    return t;
}

__device__ __forceinline__ unsigned smid() {
    unsigned id;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
    return id;
}

// The profiling build's clock: %globaltimer, one time base on every SM. (clock64 counts this SM's cycles; a clock
// change inside a step bent its two-point per-block map to ns by up to 512 ns, more than the invariants allow.)
__device__ __forceinline__ long long prof_now() { return (long long)globaltimer(); }

// Stamps of the task this block is running (PS_* slots, prof_now()), written by thread 0 only.
__shared__ long long s_prof[MK_PROF_N_STAMPS];
__device__ __forceinline__ void prof_mark(int slot) {
#if MK_PROFILE
    if (threadIdx.x == 0) s_prof[slot] = prof_now();
#endif
}
// Marks inside a task kind's work (opcodes.PROF_MARKS names them): thread 0 stamps mark k when it gets there.
__shared__ long long s_pmark[MK_PROF_N_MARKS];
__device__ __forceinline__ void prof_phase(int k) {
#if MK_PROFILE
    if (threadIdx.x == 0) s_pmark[k] = prof_now();
#endif
}

// MK_STALL_PRINT (a diagnostic build, 0 by default): every wait that leaves because the step was aborted or its
// watchdog fired prints where it was (block, task, and the counter or the paged worker's wait and sequence number), so
// a hang's every stuck block shows, not only the first to time out (the control block records one). For hangs that
// appear under compute-sanitizer only, where a profile cannot run.
#ifndef MK_STALL_PRINT
#define MK_STALL_PRINT 0
#endif

// One thread: the first error of the step wins the control block (code, task, block and the code's counter / value /
// target), then every block is told to stop.
__device__ __forceinline__ void record_error(const Params& P, int code, int task, int counter = -1, int value = 0,
                                             int target = 0) {
    int* ctrl = PP(int*, ctrl);
    if (atomicCAS(ctrl + CTRL_ERR_CODE, 0, code) == 0) {
        ctrl[CTRL_ERR_TASK] = task;
        ctrl[CTRL_ERR_COUNTER] = counter;
        ctrl[CTRL_ERR_VALUE] = value;
        ctrl[CTRL_ERR_TARGET] = target;
        ctrl[CTRL_ERR_BLOCK] = blockIdx.x;
    }
    __threadfence();
    atomicExch(ctrl + CTRL_ABORT, 1);
}

// Thread 0 only. Spins until counters[c] >= target. Returns false when the step is aborted (another block's
// watchdog fired) or when this wait exceeds the watchdog: then it records which counter is stuck and aborts.
__device__ __noinline__ bool wait_counter(const Params& P, int c, int target, int task) {
    int* ctrl = PP(int*, ctrl);
    const int* counters = PP(const int*, counters);
    if (ld_acquire(counters + c) >= target) return true;
    const unsigned long long t0 = globaltimer();
    const unsigned long long limit = (unsigned long long)PL(watchdog_ns);
    unsigned ns = 20;
    while (true) {
        __nanosleep(ns);
        if (ns < 200) ns += ns;
        int v = ld_acquire(counters + c);
        if (v >= target) return true;
        if (ld_volatile(ctrl + CTRL_ABORT)) {
#if MK_STALL_PRINT
            printf("mk stall: block %d task %d left its wait on counter %d at %d of %d (abort)\n", blockIdx.x, task,
                   c, v, target);
#endif
            return false;
        }
        if (globaltimer() - t0 > limit) {
#if MK_STALL_PRINT
            printf("mk stall: block %d task %d watchdog on counter %d at %d of %d\n", blockIdx.x, task, c, v, target);
#endif
            record_error(P, MK_ERR_WATCHDOG, task, c, v, target);
            return false;
        }
    }
}

// All threads: wait for (c, target) (c < 0: nothing). Returns false if the step was aborted.
__device__ __forceinline__ bool block_wait(const Params& P, int c, int target, int task) {
    int ok = 1;
    if (c >= 0 && threadIdx.x == 0) ok = wait_counter(P, c, target, task) ? 1 : 0;
    return __syncthreads_and(ok) != 0;
}

// Every task kind checks its shared-memory layout against the launch's dynamic shared memory before using it
// (uniform over the block): a host/kernel layout mismatch is ERR_SMEM with both sizes, never a silent overflow.
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ bool smem_fits(const Params& P, size_t need, int task) {
    const unsigned have = dynamic_smem_bytes();
    if (need <= have) return true;
    if (threadIdx.x == 0) record_error(P, MK_ERR_SMEM, task, -1, (int)need, (int)have);
    return false;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// (value, index) argmax: larger value wins, ties go to the smaller index.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        int i2 = __shfl_xor_sync(0xffffffffu, i, o);
        if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
    }
}

// Block-wide sum (all threads get the result). `red` holds MK_NUM_WARPS floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < MK_NUM_WARPS; w++) s += red[w];
    return s;
}

// ---- shared by every task kind ----------------------------------------------------------------------------------
#define NT MK_NUM_THREADS
#define NW MK_NUM_WARPS
#define MB MK_MAX_BATCH

// MK_SMEM_ALIGN: the alignment of the dynamic shared memory's start. It begins right after the static shared memory
// (1 KB reserved + mk_decode's own; nvcc pads that to this alignment), so at 16 every page, tile and KV buffer the
// plans place at multiples of 128 bytes from it lies 32 bytes past a 128-byte line in mk_decode (3616 static bytes)
// and 64 in mk_read_peak (1088). Whether a bulk copy lands slower there: benchmarks/smem_align.cu. 128 costs the
// static reserve 96 bytes (test_build checks the padded figure against opcodes.SMEM_RESERVE). Under test.
#ifndef MK_SMEM_ALIGN
#define MK_SMEM_ALIGN 128
#endif
static_assert(MK_SMEM_ALIGN >= 16 && (MK_SMEM_ALIGN & (MK_SMEM_ALIGN - 1)) == 0, "MK_SMEM_ALIGN: a power of two >= 16");
extern __shared__ __align__(MK_SMEM_ALIGN) unsigned char smem[];

// The offset from the dynamic shared memory's start of the first MK_SWZ_ALIGN-aligned address at or after `off`
// (a swizzled tile's buffer: every box lands at a multiple of 1024 bytes, the 128-byte swizzle's period).
__device__ __forceinline__ size_t swz_align(size_t off) {
    const unsigned base = smem_addr(smem);
    return (size_t)((((unsigned)(base + off) + (MK_SWZ_ALIGN - 1u)) & ~(MK_SWZ_ALIGN - 1u)) - base);
}

// The barrier of the warps that run a task: the whole block (NWC == NW), or warps 0..NWC-1 on named barrier 1 (a
// warp-specialised task whose other warps load).
template <int NWC>
__device__ __forceinline__ void group_sync() {
    if constexpr (NWC == NW) __syncthreads();
    else asm volatile("bar.sync 1, %0;\n" ::"n"(NWC * 32) : "memory");
}

// Warps 0..NWC-1: everything they wrote is published, then counters[c] += 1 (release, gpu scope). The task's end
// stamp is taken before the release, so no consumer can see the counter before it.
template <int NWC>
__device__ __forceinline__ void group_signal(const Params& P, int c) {
    group_sync<NWC>();
    prof_mark(PS_END);
    if (c >= 0 && threadIdx.x == 0) {
        red_release(PP(int*, counters) + c, 1);
    }
}
__device__ __forceinline__ void block_signal(const Params& P, int c) { group_signal<NW>(P, c); }

// The block's next ticket (the persistent loop in mk_kernel.cu reads it after a barrier).
__shared__ int s_next;

// Thread 0 (others pass), once a task has signalled: with claim_ahead == 0 it claims the block's next ticket now, so
// no ticket waits behind this task's dependency wait while another block could run it.
__device__ __forceinline__ void claim_after_signal(const Params& P) {
    if (threadIdx.x == 0 && !PI(claim_ahead)) s_next = atomicAdd(PP(int*, ctrl) + CTRL_TICKET, 1);
}

// All threads, at the end of a task: its signal, then the next claim. MK_CLAIM_FIRST=1: warp 1's first thread makes
// the claim while thread 0 fences and releases, instead of thread 0 after its release: the fence waits for the
// block's output stores to be acknowledged (~1-2 us under load) and the claim's round trip then came on top (a SASS
// audit, session 24: fence, REDG, ATOM, then the STS of s_next waiting for it). On its own warp the claim holds no
// register across the fence (thread 0 making it before its fence cost mk_decode a 4-byte spill). A ticket carries
// no data, so the claim needs no ordering against the task's stores; the persistent loop reads s_next after a
// barrier. 0: as before. (Session 24 measured thread 0 making the claim before its fence: b1 8K -1.4%, b8 -0.9%, but
// it spilled; session 25 measured this form against 0, two builds each: b1 8K -0.6%, b8 -0.5%, b16 -0.4%.)
#ifndef MK_CLAIM_FIRST
#define MK_CLAIM_FIRST 1
#endif
static_assert(NT > 32, "MK_CLAIM_FIRST claims on warp 1");
__device__ __forceinline__ void task_signal(const Params& P, int c) {
#if MK_CLAIM_FIRST
    group_sync<NW>();
    prof_mark(PS_END);
    if (threadIdx.x == 0 && c >= 0) {
        red_release(PP(int*, counters) + c, 1);
    }
    if (threadIdx.x == 32 && !PI(claim_ahead)) s_next = atomicAdd(PP(int*, ctrl) + CTRL_TICKET, 1);
#else
    block_signal(P, c);
    claim_after_signal(P);
#endif
}

// ---- small accessors -----------------------------------------------------------------------------------------
// MK_CONST_TABLES=1: the per-layer tables (layer_info, the weight pointers) in __constant__
// memory as well, copied there by mk_launch when the backend's tables change (params' tables_version), so their
// reads after a dependency wait (a fused norm's previous-layer MoE index and norm weights, an epilogue's bias
// pointer or KV group) do not go back to L2 either. Models of at most MK_MAX_TABLE_LAYERS layers (opcodes.py; the
// backend refuses more). 0: the tables in global memory. Not yet measured
#ifndef MK_CONST_TABLES
#define MK_CONST_TABLES 0
#endif
#if MK_CONST_TABLES
__constant__ int c_layer_info[MK_MAX_TABLE_LAYERS * MK_LAYER_INFO_INTS];
__constant__ long long c_wptrs[MK_MAX_TABLE_LAYERS * MK_WPTR_INTS];
#endif
__device__ __forceinline__ const int* layer_info(const Params& P, int l) {
#if MK_CONST_TABLES
    return c_layer_info + l * MK_LAYER_INFO_INTS;
#else
    return PP(const int*, layer_info) + l * MK_LAYER_INFO_INTS;
#endif
}
__device__ __forceinline__ const long long* layer_wptr(const Params& P, int l) {
#if MK_CONST_TABLES
    return c_wptrs + l * MK_WPTR_INTS;
#else
    return PP(const long long*, wptrs) + l * MK_WPTR_INTS;
#endif
}
__device__ __forceinline__ const int* step_in(const Params& P) { return PP(const int*, step); }

// Waits of the record (thread 0 spins; everyone gets the verdict).
__device__ __forceinline__ bool wait_rec(const Params& P, const int* rec, int ticket) {
    int ok = 1;
    if (threadIdx.x == 0) {
        for (int k = 0; k < MK_MAX_WAITS && ok; k++) {
            const int c = rec[RF_W0C + 2 * k];
            if (c >= 0) ok = wait_counter(P, c, rec[RF_W0T + 2 * k], ticket) ? 1 : 0;
        }
    }
    prof_mark(PS_WAITED);
    return __syncthreads_and(ok) != 0;
}

// The KV pool of layer `lig` of KV group g: block blk's K rows start at + blk * 2 * bs * KVs, its V rows bs * KVs later.
__device__ __forceinline__ bf16* kv_layer_base(const Params& P, int g, int lig) {
    const size_t KVs = (size_t)PI(n_kv) * PI(head_dim), bs = PI(block_size);
    bf16* base = g == 0 ? PP(bf16*, kv0) : PP(bf16*, kv1);
    const long long nblk = g == 0 ? PL(nblk0) : PL(nblk1);
    return base + lig * ((size_t)nblk * 2 * bs * KVs);
}

// Where row s's block-table entries of KV group g start: its entry for logical block i is tables[kv_table_off + i]
// (the table holds the row's blocks from tbase on; windowed groups drop the ones that left the window).
// The step inputs hold, from kv_table_entries(P, s) on, row s's table start in group g at [g] and the first logical
// block that start holds at [kv_table_base_stride(P) + g].
__device__ __forceinline__ const int* kv_table_entries(const Params& P, int s) {
    return step_in(P) + 2 * PI(Bm) + s * PI(n_groups);
}
__device__ __forceinline__ int kv_table_base_stride(const Params& P) { return PI(Bm) * PI(n_groups); }
__device__ __forceinline__ int kv_table_off(const Params& P, int g, int s) {
    const int* e = kv_table_entries(P, s);
    return e[g] - e[kv_table_base_stride(P) + g];
}

// Key position kp of row s in layer lig's pool of KV group g: its K row (its V row is block_size * KVs later).
__device__ __forceinline__ bf16* kv_slot(const Params& P, int g, int lig, int s, int kp) {
    const int bs = PI(block_size);
    const int blk = PP(const int*, tables)[kv_table_off(P, g, s) + kp / bs];
    return kv_layer_base(P, g, lig) + ((size_t)blk * 2 * bs + (kp % bs)) * ((size_t)PI(n_kv) * PI(head_dim));
}

// ---- profiling records (thread 0) -----------------------------------------------------------------------------
__device__ __forceinline__ void prof_record(long long* r, int op, int layer, long long arg) {
#if MK_PROFILE
    if (threadIdx.x != 0) return;
    if (s_prof[PS_LANDED] < s_prof[PS_WAITED]) s_prof[PS_LANDED] = s_prof[PS_WAITED];   // tasks that stage nothing
    if (s_prof[PS_LANDED] < s_prof[PS_ISSUED]) s_prof[PS_LANDED] = s_prof[PS_ISSUED];
    if (s_prof[PS_COMPUTED] < 0) s_prof[PS_COMPUTED] = s_prof[PS_END];
    r[PF_BLOCK] = blockIdx.x; r[PF_SM] = smid(); r[PF_OP] = op; r[PF_LAYER] = layer; r[PF_ARG] = arg;
    r[PF_CLAIM] = s_prof[PS_CLAIM]; r[PF_ISSUED] = s_prof[PS_ISSUED]; r[PF_WAITED] = s_prof[PS_WAITED];
    r[PF_LANDED] = s_prof[PS_LANDED]; r[PF_COMPUTED] = s_prof[PS_COMPUTED]; r[PF_END] = s_prof[PS_END];
    for (int k = 0; k < MK_PROF_N_MARKS; k++) r[PF_M0 + k] = s_pmark[k];
#endif
}

__device__ __forceinline__ void prof_reset() {
#if MK_PROFILE
    if (threadIdx.x == 0) {
        const long long t = prof_now();
        for (int k = 0; k < MK_PROF_N_STAMPS; k++) s_prof[k] = t;
        s_prof[PS_COMPUTED] = -1;       // set by the GEMV core; tasks without one get their end stamp
        for (int k = 0; k < MK_PROF_N_MARKS; k++) s_pmark[k] = -1;
    }
#endif
}
