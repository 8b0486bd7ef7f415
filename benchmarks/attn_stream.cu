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
// token); 256: contiguous rows.
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

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

// Block b streams rows [b * rows_per_block, ...) of `src` (row i at i * stride bytes), `rows_chunk` rows per chunk.
template <int METHOD>
__global__ void __launch_bounds__(NT, 1) stream(const unsigned char* src, long long stride, int rows_per_block,
                                                 int rows_chunk, int stages, float* out) {
    __shared__ __align__(8) unsigned long long bar[4];
    const long long base = (long long)blockIdx.x * rows_per_block;
    const int nchunks = rows_per_block / rows_chunk;
    const int chunk_bytes = rows_chunk * ROW;
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
                cp16(dst + r * ROW + k * 16, src + (r0 + r) * stride + k * 16);
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
        for (int i = threadIdx.x; i < chunk_bytes / 16; i += NT)   // a read of every 16 bytes: the math's reads
            acc += __int_as_float(reinterpret_cast<const int4*>(s)[i].x & 0x3f800000);
        __syncthreads();
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
        cudaFuncSetAttribute(stream<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, maxsm)) {
        printf("cudaFuncSetAttribute: %s\n", cudaGetErrorString(cudaGetLastError()));
        return 1;
    }
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    printf("%d blocks of %d threads, %d rows of %d B per block\n", blocks, NT, rows_per_block, ROW);
    const char* names[3] = {"cp.async16", "bulk/row", "bulk16KB"};
    for (int method = 0; method < 3; method++)
        for (long long stride : {1024LL, 256LL}) {
            if (method == 2 && stride != 256) continue;   // (contiguous only)
            for (int rows_chunk : {128, 256})
                for (int stages = 2; stages <= 4; stages++) {
                    const size_t sm_need = (size_t)stages * rows_chunk * ROW;
                    if (sm_need > (size_t)maxsm) continue;
                    auto launch = [&]() {
                        if (method == 0)
                            stream<0><<<blocks, NT, sm_need>>>(src, stride, rows_per_block, rows_chunk, stages, out);
                        else if (method == 1)
                            stream<1><<<blocks, NT, sm_need>>>(src, stride, rows_per_block, rows_chunk, stages, out);
                        else
                            stream<2><<<blocks, NT, sm_need>>>(src, stride, rows_per_block, rows_chunk, stages, out);
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
                    printf("%-10s stride %4lld chunk %3d rows (%3d KB) stages %d: %7.0f GB/s, %5.1f GB/s per SM%s%s\n",
                           names[method], stride, rows_chunk, rows_chunk * ROW / 1024, stages,
                           moved / (ms * 1e6), moved / (ms * 1e6) / blocks, err ? " ERROR " : "",
                           err ? cudaGetErrorString(err) : "");
                }
        }
    return 0;
}
