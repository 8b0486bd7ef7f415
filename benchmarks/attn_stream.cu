// Microbenchmark of decode attention's K/V stream, without the megakernel around it: one block per SM (512 threads,
// as the megakernel), each streaming its own rows of 256 bytes (one kv head's K or V row at head_dim 128) through a
// ring of `stages` chunks in shared memory, the way task_attn_d does, with a token amount of math per chunk. It
// answers what one SM's attention loop can pull from HBM by each copy method, ring depth and row stride, with every
// SM doing the same (as in an attention phase) - the ceiling the megakernel's attention splits run under.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/attn_stream.cu -o /tmp/attn_stream
//   /tmp/attn_stream            (prints one line per configuration: GB/s over all SMs and per SM)
// Methods: 0 cp.async of 16 bytes by every thread, one commit group per chunk (today's default path); 1 one bulk
// copy (TMA) per 256-byte row on a per-stage mbarrier (MK_ATTN_BULK=1); 2 bulk copies of 16 KB of consecutive rows
// (what a contiguous layout would allow). Stride 1024: the KV pool's rows of one kv head (4 heads x 256 bytes per
// token); 256: contiguous rows. The cp.async method also runs with the split's own per-chunk math (a chunk's first
// half of rows as K, the second as V, rows padded to 272 bytes as task_attn_d pads them): "+math" one warp per
// 16-key slice (task_attn_d's single-warp layout: S = Q K^T, the online softmax, O += P V on mma.m16n8k16, 32 fp32
// accumulators per thread), "+math2" two warps per slice with half the dims each (MK_ATTN_DSPLIT's variant). Against
// the same copies without math, they say whether the split's math and barriers hold a chunk (the step's traces: ~3.4
// us per 64 KB chunk, where the copies alone take ~2). "ws+math": the same math with no block barrier, warp-specialised
// (one producer warp issues a bulk copy per row into a stage once its `empty` mbarrier says the 8 computing warps
// left it; each computing warp waits on the stage's `full` mbarrier itself): the design a barrier-free attention
// split would have. "+math qpad" / "+math2 qpad": the math modes with Q's rows padded by 16 bytes (the kernel's
// MK_ATTN_PAD=1, csrc/mk_attn_layout.cuh): unpadded each Q fragment load is an 8-way bank conflict, so the pairs say
// how much of the math's cost is those conflicts. "+math qpad fast" / "+math2 qpad fast": the padded math as
// MK_ATTN_MATH=1 builds it (csrc/mk_attn_math.cuh: K by ldmatrix, Q K^T unrolled by 4, ex2.approx).
// Every math mode runs the kernel's own chunk math (csrc/mk_attn_math.cuh), not a copy of it.
#include <cstdio>
#include <cstdlib>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include "../megakernel/kernel/csrc/mk_attn_layout.cuh"
#include "../megakernel/kernel/csrc/mk_attn_math.cuh"

constexpr int NT = 512;
constexpr int ROW = 256;                      // bytes per K or V row of one kv head (head_dim 128, bf16)

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void cp16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned n) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned long long* b, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(b)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
    asm volatile(
        "{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}\n" ::"r"(
            smem_u32(b)),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void bulk(void* dst, const void* src, unsigned bytes, unsigned long long* b) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            smem_u32(dst)),
        "l"(src), "r"(bytes), "r"(smem_u32(b))
        : "memory");
}

template <int STAGES>
__device__ __forceinline__ void wait_groups(int pending) {
    if (pending >= 3) asm volatile("cp.async.wait_group 3;\n" ::: "memory");
    else if (pending == 2) asm volatile("cp.async.wait_group 2;\n" ::: "memory");
    else if (pending == 1) asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    else asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

extern __shared__ __align__(128) unsigned char smem[];

constexpr int HD = 128;                       // head_dim of the math modes (one row: HD bf16 = ROW bytes)
constexpr int PITCH = ROW + 16;               // the math modes' padded rows (task_attn_d: d + 8 elements)
constexpr int GQ = 8;                         // query heads per kv head (North: 32 / 4)

// One computing warp's share of a chunk of CH keys (K rows 0..CH-1, V rows CH..2CH-1 at PITCH bytes): task_attn_d's
// own math (csrc/mk_attn_math.cuh), its 16-key slice against sQ's GQ query rows over NP 16-dim pairs from np0 on (all
// of them: KS = HD / 16; the two-warp variant: half each). QPAD: elements after each Q row; FAST: MK_ATTN_MATH=1.
template <int NP, int QPAD = 0, bool FAST = false>
__device__ __forceinline__ void chunk_math(const unsigned char* chunk, int CH, const __nv_bfloat16* sQ, int slice,
                                           int np0, float& m_run, float& l_run, float (*o)[2]) {
    constexpr int KS = HD / 16;
    const __nv_bfloat16* sK = reinterpret_cast<const __nv_bfloat16*>(chunk);
    const AttnKVPadded<PITCH / 2> kv{sK, sK + (size_t)CH * (PITCH / 2), 0};
    attn_chunk_math<KS, NP, FAST>(AttnQSmem<HD, QPAD>{sQ, GQ}, kv, slice * 16, CH, 0, 0.0883883f, np0, m_run, l_run,
                                  o);
}

// Block b streams rows [b * rows_per_block, ...) of `src` (row i at i * stride bytes), `rows_chunk` rows per chunk.
// MATH (METHOD 0 only): 0 a read of every 16 bytes; 1 the split's math, one warp per 16-key slice; 2 two warps.
// QPAD: elements after each of Q's rows (the values are only for timing); FAST: the math as MK_ATTN_MATH=1 builds it.
template <int METHOD, int MATH = 0, int QPAD = 0, bool FAST = false>
__global__ void __launch_bounds__(NT, 1) stream(const unsigned char* src, long long stride, int rows_per_block,
                                                 int rows_chunk, int stages, float* out) {
    static_assert(MATH == 0 || METHOD == 0, "the math modes load by cp.async");
    constexpr int pitch = MATH ? PITCH : ROW;
    constexpr int KS = HD / 16, NP = MATH == 2 ? KS / 2 : KS;
    const int warp = threadIdx.x >> 5, CH = rows_chunk / 2, nslices = CH / 16;
    const int slice = MATH == 2 ? warp % nslices : warp, np0 = MATH == 2 ? (warp / nslices) * NP : 0;
    const bool computes = warp < (MATH == 2 ? 2 : 1) * nslices;
    float m_run = -INFINITY, l_run = 0.f, o[2 * NP][2];
#pragma unroll
    for (int i = 0; i < 2 * NP; i++) o[i][0] = o[i][1] = 0.f;
    __shared__ __align__(8) unsigned long long bar[4];
    const long long base = (long long)blockIdx.x * rows_per_block;
    const int nchunks = rows_per_block / rows_chunk;
    const int chunk_bytes = rows_chunk * pitch;
    __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem + (size_t)stages * chunk_bytes);   // [GQ][HD]
    if (MATH)
        for (int i = threadIdx.x; i < GQ * q_pitch<HD, QPAD>(); i += NT)
            sQ[i] = __float2bfloat16(0.01f * ((i * 7) % 13));
    if (threadIdx.x == 0)
        for (int s = 0; s < 4; s++) mbar_init(&bar[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncthreads();
    unsigned phase = 0;
    auto issue = [&](int c) {
        unsigned char* dst = smem + (size_t)(c % stages) * chunk_bytes;
        const long long r0 = base + (long long)c * rows_chunk;
        if (METHOD == 0) {
            for (int u = threadIdx.x; u < rows_chunk * (ROW / 16); u += NT) {
                const int r = u / (ROW / 16), k = u % (ROW / 16);
                cp16(dst + r * pitch + k * 16, src + (r0 + r) * stride + k * 16);
            }
            asm volatile("cp.async.commit_group;\n" ::: "memory");
        } else if (METHOD == 1) {
            unsigned long long* b = &bar[c % stages];
            if (threadIdx.x == 0) mbar_expect(b, (unsigned)chunk_bytes);
            for (int r = threadIdx.x; r < rows_chunk; r += NT) bulk(dst + r * ROW, src + (r0 + r) * stride, ROW, b);
        } else {
            unsigned long long* b = &bar[c % stages];
            const int piece = 16384, n = chunk_bytes / piece;
            if (threadIdx.x == 0) mbar_expect(b, (unsigned)chunk_bytes);
            if (threadIdx.x < n) bulk(dst + threadIdx.x * piece, src + r0 * ROW + (long long)threadIdx.x * piece,
                                      piece, b);
        }
    };
    float acc = 0.f;
    int issued = 0;
    for (; issued < stages - 1 && issued < nchunks; issued++) issue(issued);
    for (int c = 0; c < nchunks; c++) {
        if (issued < nchunks) { issue(issued); issued++; }
        if (METHOD == 0) {
            wait_groups<4>(issued - c - 1);
        } else {
            const int st = c % stages;
            mbar_wait(&bar[st], (phase >> st) & 1u);
            phase ^= 1u << st;
        }
        __syncthreads();
        const unsigned char* s = smem + (size_t)(c % stages) * chunk_bytes;
        if (MATH) {
            if (computes) chunk_math<NP, QPAD, FAST>(s, CH, sQ, slice, np0, m_run, l_run, o);
        } else {
            for (int i = threadIdx.x; i < chunk_bytes / 16; i += NT)   // a read of every 16 bytes
                acc += __int_as_float(reinterpret_cast<const int4*>(s)[i].x & 0x3f800000);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2 * NP; i++) acc += o[i][0] + o[i][1];
    acc += l_run;
    if (acc == 1234.5f) out[blockIdx.x] = acc;
}

// "ws+math": warp NT/32 - 1 produces (a bulk copy per row, padded, into the stage its `empty` barrier freed), warps
// 0..CH/16-1 compute (each waits on the stage's `full` barrier, runs its slice, arrives on `empty`); no block barrier.
__global__ void __launch_bounds__(NT, 1) stream_ws(const unsigned char* src, long long stride, int rows_per_block,
                                                   int rows_chunk, int stages, float* out) {
    __shared__ __align__(8) unsigned long long full[4], empty[4];
    constexpr int KS = HD / 16;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, CH = rows_chunk / 2, nslices = CH / 16;
    const long long base = (long long)blockIdx.x * rows_per_block;
    const int nchunks = rows_per_block / rows_chunk, chunk_bytes = rows_chunk * PITCH;
    __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem + (size_t)stages * chunk_bytes);
    for (int i = threadIdx.x; i < GQ * HD; i += NT) sQ[i] = __float2bfloat16(0.01f * ((i * 7) % 13));
    if (threadIdx.x == 0)
        for (int st = 0; st < 4; st++) { mbar_init(&full[st], 1); mbar_init(&empty[st], nslices); }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncthreads();
    float acc = 0.f;
    if (warp == NT / 32 - 1) {
        for (int c = 0; c < nchunks; c++) {
            const int st = c % stages, k = c / stages;
            if (k > 0) mbar_wait(&empty[st], (k - 1) & 1);
            if (lane == 0) mbar_expect(&full[st], (unsigned)(rows_chunk * ROW));
            __syncwarp();
            unsigned char* dst = smem + (size_t)st * chunk_bytes;
            const long long r0 = base + (long long)c * rows_chunk;
            for (int r = lane; r < rows_chunk; r += 32) bulk(dst + r * PITCH, src + (r0 + r) * stride, ROW, &full[st]);
        }
    } else if (warp < nslices) {
        float m_run = -INFINITY, l_run = 0.f, o[2 * KS][2];
#pragma unroll
        for (int i = 0; i < 2 * KS; i++) o[i][0] = o[i][1] = 0.f;
        for (int c = 0; c < nchunks; c++) {
            const int st = c % stages;
            mbar_wait(&full[st], (c / stages) & 1);
            chunk_math<KS>(smem + (size_t)st * chunk_bytes, CH, sQ, warp, 0, m_run, l_run, o);
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[st]);
        }
#pragma unroll
        for (int i = 0; i < 2 * KS; i++) acc += o[i][0] + o[i][1];
        acc += l_run;
    }
    if (acc == 1234.5f) out[blockIdx.x] = acc;
}

int main(int argc, char** argv) {
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int blocks = argc > 1 ? atoi(argv[1]) : sms;
    const int rows_per_block = 16384;              // 4 MB of rows per block (stride 256), 16 MB of span at 1024
    const long long max_stride = 1024;
    const size_t bytes = (size_t)blocks * rows_per_block * max_stride + (1 << 20);
    unsigned char* src;
    float* out;
    cudaMalloc(&src, bytes);
    cudaMemset(src, 0x3c, bytes);
    cudaMalloc(&out, 4 * blocks);
    int maxsm = 0;
    cudaDeviceGetAttribute(&maxsm, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    maxsm -= 1024;                                 // (the kernel's static shared memory: its mbarriers)
    if (cudaFuncSetAttribute(stream<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, maxsm) ||
        cudaFuncSetAttribute(stream<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, maxsm) ||
        cudaFuncSetAttribute(stream<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, maxsm) ||
        cudaFuncSetAttribute(stream<0, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, maxsm) ||
        cudaFuncSetAttribute(stream<0, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, maxsm) ||
        cudaFuncSetAttribute(stream<0, 1, 8>, cudaFuncAttributeMaxDynamicSharedMemorySize, maxsm) ||
        cudaFuncSetAttribute(stream<0, 2, 8>, cudaFuncAttributeMaxDynamicSharedMemorySize, maxsm) ||
        cudaFuncSetAttribute(stream<0, 1, 8, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, maxsm) ||
        cudaFuncSetAttribute(stream<0, 2, 8, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, maxsm) ||
        cudaFuncSetAttribute(stream_ws, cudaFuncAttributeMaxDynamicSharedMemorySize, maxsm)) {
        printf("cudaFuncSetAttribute: %s\n", cudaGetErrorString(cudaGetLastError()));
        return 1;
    }
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    printf("%d blocks of %d threads, %d rows of %d B per block\n", blocks, NT, rows_per_block, ROW);
    const char* names[10] = {"cp.async16", "bulk/row", "bulk16KB", "+math", "+math2", "ws+math", "+math qpad",
                             "+math2 qpad", "+math qpad fast", "+math2 qpad fast"};
    for (int method = 0; method < 10; method++)
        for (long long stride : {1024LL, 256LL}) {
            if (method == 2 && stride != 256) continue;   // (contiguous only)
            if (method >= 3 && stride != 1024) continue;  // (the math modes: the KV pool's stride)
            for (int rows_chunk : {128, 256})
                for (int stages = 2; stages <= 4; stages++) {
                    if (method >= 3 && rows_chunk != 256) continue;   // (128 keys: 8 slices, as task_attn_d)
                    const size_t sm_need = method >= 3 ? (size_t)stages * rows_chunk * PITCH + GQ * q_pitch<HD, 8>() * 2
                                                       : (size_t)stages * rows_chunk * ROW;
                    if (sm_need > (size_t)maxsm) continue;
                    auto launch = [&]() {
                        const int rpb = rows_per_block;
                        if (method == 0) stream<0><<<blocks, NT, sm_need>>>(src, stride, rpb, rows_chunk, stages, out);
                        if (method == 1) stream<1><<<blocks, NT, sm_need>>>(src, stride, rpb, rows_chunk, stages, out);
                        if (method == 2) stream<2><<<blocks, NT, sm_need>>>(src, stride, rpb, rows_chunk, stages, out);
                        if (method == 3)
                            stream<0, 1><<<blocks, NT, sm_need>>>(src, stride, rpb, rows_chunk, stages, out);
                        if (method == 4)
                            stream<0, 2><<<blocks, NT, sm_need>>>(src, stride, rpb, rows_chunk, stages, out);
                        if (method == 5)
                            stream_ws<<<blocks, NT, sm_need>>>(src, stride, rpb, rows_chunk, stages, out);
                        if (method == 6)
                            stream<0, 1, 8><<<blocks, NT, sm_need>>>(src, stride, rpb, rows_chunk, stages, out);
                        if (method == 7)
                            stream<0, 2, 8><<<blocks, NT, sm_need>>>(src, stride, rpb, rows_chunk, stages, out);
                        if (method == 8)
                            stream<0, 1, 8, true><<<blocks, NT, sm_need>>>(src, stride, rpb, rows_chunk, stages, out);
                        if (method == 9)
                            stream<0, 2, 8, true><<<blocks, NT, sm_need>>>(src, stride, rpb, rows_chunk, stages, out);
                    };
                    launch();
                    cudaEventRecord(e0);
                    const int reps = 5;
                    for (int i = 0; i < reps; i++) launch();
                    cudaEventRecord(e1);
                    cudaEventSynchronize(e1);
                    float ms = 0;
                    cudaEventElapsedTime(&ms, e0, e1);
                    const cudaError_t err = cudaGetLastError();
                    const double moved = (double)blocks * rows_per_block * ROW * reps;
                    const double chunk_us = ms * 1e3 / reps / (rows_per_block / rows_chunk);
                    printf("%-10s stride %4lld chunk %3d rows (%3d KB) stages %d: %7.0f GB/s, %5.1f GB/s per SM, "
                           "%5.2f us per chunk%s%s\n", names[method], stride, rows_chunk, rows_chunk * ROW / 1024,
                           stages, moved / (ms * 1e6), moved / (ms * 1e6) / blocks, chunk_us, err ? " ERROR " : "",
                           err ? cudaGetErrorString(err) : "");
                    if (err) return 1;
                }
        }
    return 0;
}
