// Microbenchmark: the paged MoE worker's per-page math at one input row, alone on an SM (no HBM traffic).
// MK_PG_PAGE_STATS traces (SPEED_NOTES, session 21) put a b1 page's math at ~1.5 us (gate/up: 4 rows of 2048), ~2.8
// (down: 10 rows of 768) and ~2.1 (O: 2 rows of 4096) per computing warp, while its warps wait ~5 us per page for
// the copy: with 12 pages per SM, a page in math is a page not in flight. This times the kernel's page products
// (csrc/mk_page_math.cuh: pg_rows, the CUDA-core loop, as "v0"; pg_rows_seg, tensor cores with K in segments, as
// "seg") on `warps` warps at once, each on its own 16 KB page in shared memory, and prints ns per page per warp and
// the SM's GB/s of weights; "check" lines compare seg with pg_rows. (Session 21's calls 4-5 also timed two
// alternatives, a rows-outer CUDA-core loop and x as the MMA's A operand: results/speed_20261204s21/.)
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/page_math.cu -o /tmp/page_math
//   /tmp/page_math
#include <cstdio>
#include <cstdlib>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include "../megakernel/kernel/csrc/mk_page_math.cuh"   // pg_rows, pg_rows_seg: the kernel's own code

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int PAGE = 16384;
constexpr int MAXW = 12;
extern __shared__ __align__(128) unsigned char smem[];







// Every computing warp w < warps: `reps` times, its page at smem + w * PAGE (nr rows of K) times x (after the
// pages); per-warp clock cycles into cyc[blockIdx.x * MAXW + w].
template <int V, int RMAX>
__global__ void __launch_bounds__(512, 1) bench(int warps, int nr, int K, int reps, long long* cyc, float* sink) {
    const int warp = threadIdx.x >> 5;
    for (int i = threadIdx.x; i < (MAXW * PAGE + 8192) / 4; i += blockDim.x)
        reinterpret_cast<unsigned*>(smem)[i] = 0x3f803f80u ^ (i * 2654435761u & 0x00ff00ffu);
    __syncthreads();
    if (warp >= warps) return;
    const __nv_bfloat16* Wp = reinterpret_cast<const __nv_bfloat16*>(smem + (size_t)warp * PAGE);
    const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(smem + (size_t)MAXW * PAGE);
    __shared__ float outs[MAXW][32];
    float s = 0.f;
    const long long t0 = clock64();
    for (int i = 0; i < reps; i++) {
        if constexpr (V == 0) pg_rows<RMAX>(Wp, x, nr, K, outs[warp]);
        else pg_rows_seg<RMAX>(Wp, x, nr, K, outs[warp]);
        __syncwarp();
        s += outs[warp][i % nr];
    }
    const long long t1 = clock64();
    if ((threadIdx.x & 31) == 0) { cyc[blockIdx.x * MAXW + warp] = t1 - t0; sink[blockIdx.x * MAXW + warp] = s; }
}

// pg_rows_seg against pg_rows on one page of pseudo-random weights: the largest |difference| relative to the
// largest |output|, into err[0].
template <int S, int RMAX>
__global__ void check(int nr, int K, float* err) {
    for (int i = threadIdx.x; i < (PAGE + 8192) / 2; i += blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u;
        h ^= h >> 13;
        reinterpret_cast<unsigned short*>(smem)[i] = (unsigned short)(0x3c00u + (h & 0x3ffu)) ^ ((h >> 10) & 1u ? 0x8000u : 0u);
    }
    __syncthreads();
    if (threadIdx.x >= 32) return;
    __shared__ float a[32], b[32];
    const __nv_bfloat16* Wp = reinterpret_cast<const __nv_bfloat16*>(smem);
    const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(smem + PAGE);
    pg_rows<RMAX>(Wp, x, nr, K, a);
    pg_rows_seg<S>(Wp, x, nr, K, b);
    __syncwarp();
    if (threadIdx.x == 0) {
        float mx = 0.f, d = 0.f;
        for (int r = 0; r < nr; r++) { mx = fmaxf(mx, fabsf(a[r])); d = fmaxf(d, fabsf(a[r] - b[r])); }
        err[0] = d / fmaxf(mx, 1e-30f);
    }
}

template <int V, int RMAX>
void run(const char* name, int warps, int nr, int K, int sms, long long* cyc, float* sink, double ghz) {
    const int reps = 200, smem_bytes = MAXW * PAGE + 8192;
    CK(cudaFuncSetAttribute(bench<V, RMAX>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    bench<V, RMAX><<<sms, 512, smem_bytes>>>(warps, nr, K, reps, cyc, sink);
    CK(cudaDeviceSynchronize());
    long long h[MAXW * 132];
    CK(cudaMemcpy(h, cyc, sizeof(long long) * MAXW * sms, cudaMemcpyDeviceToHost));
    double mx = 0;
    for (int b = 0; b < sms; b++)
        for (int w = 0; w < warps; w++) mx = h[b * MAXW + w] > mx ? h[b * MAXW + w] : mx;
    const double ns_page = mx / reps / ghz;
    const double gbs = (double)warps * nr * K * 2 / ns_page;      // bytes per ns = GB/s, per SM
    printf("%-6s rows %2d x K %4d, %2d warps: %7.0f ns per page per warp, %6.1f GB/s per SM\n", name, nr, K, warps,
           ns_page, gbs);
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int khz = 0;
    CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    const double ghz = khz / 1e6;
    const int sms = prop.multiProcessorCount;
    long long* cyc;
    float* sink;
    CK(cudaMalloc(&cyc, sizeof(long long) * MAXW * sms));
    CK(cudaMalloc(&sink, sizeof(float) * MAXW * sms));
    printf("# %s, clock %.2f GHz (cycles -> ns at that clock), every SM runs the same\n", prop.name, ghz);
    float* err;
    CK(cudaMalloc(&err, 4));
    auto chk = [&](auto kern, int nr, int K) {
        CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, PAGE + 8192));
        kern<<<1, 64, PAGE + 8192>>>(nr, K, err);
        CK(cudaDeviceSynchronize());
        float e = 0.f;
        CK(cudaMemcpy(&e, err, 4, cudaMemcpyDeviceToHost));
        printf("check seg rows %2d x K %4d: max |seg - pg_rows| / max |out| = %.2e\n", nr, K, e);
    };
    chk(check<4, 4>, 4, 2048);
    chk(check<4, 4>, 3, 2048);
    chk(check<8, 2>, 2, 4096);
    chk(check<8, 2>, 1, 4096);
    chk(check<1, 16>, 10, 768);
    chk(check<1, 16>, 16, 768);
    const int ws[] = {1, 4, 12};
    for (int w : ws) {
        run<0, 4>("v0", w, 4, 2048, sms, cyc, sink, ghz);
        run<1, 4>("seg", w, 4, 2048, sms, cyc, sink, ghz);
        run<0, 16>("v0", w, 10, 768, sms, cyc, sink, ghz);
        run<1, 1>("seg", w, 10, 768, sms, cyc, sink, ghz);
        run<0, 2>("v0", w, 2, 4096, sms, cyc, sink, ghz);
        run<1, 8>("seg", w, 2, 4096, sms, cyc, sink, ghz);
    }
    return 0;
}
