// Microbenchmark: does a 16 KB bulk copy (TMA) land slower into a shared-memory address that is not 128-byte aligned?
// Why it is asked: csrc/mk_peak.cuh and sm_stream.cu stream the same copies (every SM its own slice, 16 KB copies,
// 128 KB in flight, evict-first), yet mk_peak reads 3.4-3.5 TB/s and sm_stream 4.3-4.6 (SPEED_NOTES, twenty-first
// session). One difference: sm_stream's dynamic shared memory is declared __align__(128), the package's __align__(16),
// and both kernels have static shared memory before it. The package's cubin (.nv.shared.* sections) says mk_read_peak
// has 1088 static bytes (1024 reserved + its 64-byte barriers) and mk_decode 3616, so if dynamic shared memory
// starts right after them, every page of the megakernel's ring starts 32 bytes past a 128-byte line (mk_peak's 64).
// This kernel has the same 64 bytes of static barriers and an __align__(16) extern array like mk_peak; it prints
// where its dynamic shared memory starts (mod 1024), then streams with the ring at each offset from a 1024-aligned
// address, all SMs, then 88 SMs (the MoE phase's streaming SMs), the offsets interleaved across repetitions.
// Its loop is mk_read_peak's (same static barriers, policy and depth), so offset 64 is mk_read_peak's own layout: if
// that row reads ~4.5 TB/s, alignment is not the gap, and how the package launches or times mk_read_peak is.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/smem_align.cu -o /tmp/smem_align
//   /tmp/smem_align
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include "../megakernel/kernel/csrc/mk_async.cuh"   // mbar_*, bulk_load, l2_evict_first: the kernel's own copy path

constexpr int CHUNK = 16384;
constexpr int STAGES = 8;                          // 128 KB in flight per SM, as mk_peak
constexpr size_t BYTES = 4ull << 30;               // read per launch (the bench's peak buffer)
constexpr int PAD = 2048;                          // room to move the ring to any offset from a 1024-aligned address

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

extern __shared__ __align__(16) unsigned char smem[];

__global__ void __launch_bounds__(32, 1) stream(const char* src, unsigned long long slice, int offset,
                                                unsigned* base_out) {
    __shared__ __align__(8) unsigned long long bar[STAGES];
    if (threadIdx.x != 0) return;
    const unsigned base = smem_addr(smem);
    if (blockIdx.x == 0) *base_out = base;
    // stage 0 at `offset` bytes past the first 1024-aligned shared address of the dynamic memory
    unsigned char* ring = smem + (((base + 1023u) & ~1023u) - base) + offset;
    const char* from = src + (size_t)blockIdx.x * slice;
    const long long n = (long long)(slice / CHUNK);
    for (int s = 0; s < STAGES; s++) mbar_init(&bar[s], 1);
    fence_mbar_init();
    const unsigned long long pol = l2_evict_first();
    auto issue = [&](int s, long long i) {
        mbar_expect_tx(&bar[s], CHUNK);
        bulk_load(ring + (size_t)s * CHUNK, from + i * CHUNK, CHUNK, &bar[s], pol);
    };
    for (long long i = 0; i < n && i < STAGES; i++) issue((int)i, i);
    for (long long i = 0; i < n; i++) {
        const int s = (int)(i % STAGES);
        mbar_wait(&bar[s], (unsigned)((i / STAGES) & 1));
        if (i + STAGES < n) issue(s, i + STAGES);
    }
    for (int s = 0; s < STAGES; s++) mbar_inval(&bar[s]);
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    char* src;
    unsigned* base;
    CK(cudaMalloc(&src, BYTES));
    CK(cudaMemset(src, 1, BYTES));
    CK(cudaMalloc(&base, 4));
    const int smem_bytes = STAGES * CHUNK + PAD;
    CK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const int offsets[] = {0, 16, 32, 64, 96, 128};
    constexpr int N_OFF = sizeof(offsets) / sizeof(offsets[0]);
    const int grids[] = {prop.multiProcessorCount, 88};
    printf("# %s; 16 KB bulk copies, %d in flight per SM, %zu MiB per launch; GB/s best of 3 launches per offset, "
           "the offsets interleaved (offset 64 is mk_read_peak's own layout)\n", prop.name, STAGES, BYTES >> 20);
    for (int grid : grids) {
        const unsigned long long slice = BYTES / grid / CHUNK * CHUNK;
        float best[N_OFF];
        for (int k = 0; k < N_OFF; k++) best[k] = 1e30f;
        for (int rep = 0; rep < 4; rep++)                   // (each offset's first launch warms up)
            for (int k = 0; k < N_OFF; k++) {
                CK(cudaEventRecord(e0));
                stream<<<grid, 32, smem_bytes>>>(src, slice, offsets[k], base);
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                CK(cudaGetLastError());
                float ms = 0.f;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                if (rep > 0 && ms < best[k]) best[k] = ms;
            }
        unsigned b = 0;
        CK(cudaMemcpy(&b, base, 4, cudaMemcpyDeviceToHost));
        for (int k = 0; k < N_OFF; k++)
            printf("sms %3d  ring offset %4d (mod 128: %3d)  %8.1f GB/s   dynamic smem base %u (mod 128: %u)\n", grid,
                   offsets[k], offsets[k] % 128, slice * grid / (best[k] * 1e-3) / 1e9, b, b % 128);
    }
    return 0;
}
