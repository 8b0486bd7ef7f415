// The roofline's denominator by the copies the megakernel itself streams with: every SM reads its share of a buffer
// through 16 KB bulk copies (TMA) into shared memory, PEAK_STAGES in flight, nothing computed. On the H200 this
// reached 4.62 TB/s with 64 KB or more in flight per SM (benchmarks/mem_latency.cu), where a torch reduction over
// the same bytes reaches 3.97-4.17: a roofline measured by the reduction alone flatters a kernel that streams by TMA.
// A separate kernel in the same library (mk_decode's code is unchanged by it).
#pragma once
#include "mk_common.cuh"

#define PEAK_CHUNK 16384
#define PEAK_STAGES 8                 // 128 KB in flight per SM

// One warp per block; lane 0 streams block b's slice [b * slice, (b + 1) * slice) of src, slice a multiple of
// PEAK_CHUNK, through the ring of PEAK_STAGES chunks.
extern "C" __global__ void __launch_bounds__(32, 1) mk_read_peak(const char* src, unsigned long long slice) {
    __shared__ __align__(8) unsigned long long bar[PEAK_STAGES];
    if (threadIdx.x != 0) return;
    const char* base = src + (size_t)blockIdx.x * slice;
    const long long n = (long long)(slice / PEAK_CHUNK);
    for (int s = 0; s < PEAK_STAGES; s++) mbar_init(&bar[s], 1);
    fence_mbar_init();
    const unsigned long long pol = l2_evict_first();
    for (long long i = 0; i < n && i < PEAK_STAGES; i++) {
        mbar_expect_tx(&bar[i], PEAK_CHUNK);
        bulk_load(smem + i * PEAK_CHUNK, base + i * PEAK_CHUNK, PEAK_CHUNK, &bar[i], pol);
    }
    for (long long i = 0; i < n; i++) {
        const int s = (int)(i % PEAK_STAGES);
        mbar_wait(&bar[s], (unsigned)((i / PEAK_STAGES) & 1));
        if (i + PEAK_STAGES < n) {
            mbar_expect_tx(&bar[s], PEAK_CHUNK);
            bulk_load(smem + (size_t)s * PEAK_CHUNK, base + (i + PEAK_STAGES) * PEAK_CHUNK, PEAK_CHUNK, &bar[s], pol);
        }
    }
    for (int s = 0; s < PEAK_STAGES; s++) mbar_inval(&bar[s]);
}

// Launches mk_read_peak over `bytes` of `src` on `grid` blocks on `stream`; *read gets the bytes the blocks read (the
// slices' sum: bytes rounded down to grid whole chunks). 0 on success, else a cudaError_t.
extern "C" int mk_read_peak_launch(int device, const void* src, long long bytes, int grid, void* stream,
                                   long long* read) {
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return (int)e;
    if (grid <= 0 || bytes < 0) return (int)cudaErrorInvalidValue;
    const int smem_bytes = PEAK_STAGES * PEAK_CHUNK;
    e = cudaFuncSetAttribute(mk_read_peak, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (e != cudaSuccess) return (int)e;
    const unsigned long long slice = (unsigned long long)bytes / (unsigned long long)grid / PEAK_CHUNK * PEAK_CHUNK;
    *read = (long long)(slice * (unsigned long long)grid);
    mk_read_peak<<<grid, 32, smem_bytes, reinterpret_cast<cudaStream_t>(stream)>>>(
        reinterpret_cast<const char*>(src), slice);
    return (int)cudaGetLastError();
}
