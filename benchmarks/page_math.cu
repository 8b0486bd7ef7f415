// Microbenchmark: the paged MoE worker's per-page math, alone on an SM (no HBM traffic).
// MK_PG_PAGE_STATS traces (SPEED_NOTES, session 21) put a b1 page's math at ~1.5 us (gate/up: 4 rows of 2048), ~2.8
// (down: 10 rows of 768) and ~2.1 (O: 2 rows of 4096) per computing warp, while its warps wait ~5 us per page for
// the copy: with 12 pages per SM, a page in math is a page not in flight. This times the kernel's page products
// (csrc/mk_page_math.cuh: pg_rows, the CUDA-core loop, as "v0"; pg_rows_seg, tensor cores with K in segments, as
// "seg") on `warps` warps at once, each on its own 16 KB page in shared memory, and prints ns per page per warp and
// the SM's GB/s of weights; "check" lines compare seg with pg_rows. (Session 21's calls 4-5 also timed two
// alternatives, a rows-outer CUDA-core loop and x as the MMA's A operand: results/speed_20261204s21/.)
// The "rows" part times the several-row product (pg_compute_rows_tc, b2-b16 items) with one accumulator ("tc1", the
// default) and two ("tc2", MK_PG_TC_ACC=2) on up to 9 warps (a b8 ring has 10 pages; 9 fit beside 16 input rows of
// 2048), and checks both against the CUDA-core pg_compute_rows. Session 21's b8 page stats put a gate/up page's math at ~1.6 us per warp: if that is the
// chain of 128 dependent MMAs, tc2 takes about half.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/page_math.cu -o /tmp/page_math
//   /tmp/page_math
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include "../megakernel/kernel/csrc/mk_page_math.cuh"   // pg_rows, pg_rows_seg: the kernel's own code

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int PAGE = 16384;
constexpr int MAXW = 12;
constexpr int ROWS_W = 9, ROWS_X = 65536;       // the rows part: pages of 9 warps, then 16 input rows of 2048
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

// The rows part: every warp w < warps, `reps` times, its page at smem + w * PAGE (nr rows of K) times nc input rows
// (row i at x + i * K, after the pages), by pg_compute_rows_tc with ACC accumulators.
template <int ACC>
__global__ void __launch_bounds__(512, 1) bench_rows(int warps, int nr, int nc, int K, int reps, long long* cyc,
                                                      float* sink) {
    const int warp = threadIdx.x >> 5;
    for (int i = threadIdx.x; i < (ROWS_W * PAGE + ROWS_X) / 4; i += blockDim.x)
        reinterpret_cast<unsigned*>(smem)[i] = 0x3f803f80u ^ (i * 2654435761u & 0x00ff00ffu);
    __syncthreads();
    if (warp >= warps) return;
    const __nv_bfloat16* Wp = reinterpret_cast<const __nv_bfloat16*>(smem + (size_t)warp * PAGE);
    const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(smem + (size_t)ROWS_W * PAGE);
    __shared__ float outs[ROWS_W][16 * 16];
    const auto xrow = [&](int i) { return x + (size_t)i * K; };
    float s = 0.f;
    const long long t0 = clock64();
    for (int i = 0; i < reps; i++) {
        pg_compute_rows_tc<decltype(xrow), ACC>(Wp, nr, nc, K, xrow, outs[warp], 16);
        __syncwarp();
        s += outs[warp][(i % nc) * 16 + i % nr];
    }
    const long long t1 = clock64();
    if ((threadIdx.x & 31) == 0) { cyc[blockIdx.x * MAXW + warp] = t1 - t0; sink[blockIdx.x * MAXW + warp] = s; }
}

// pg_compute_rows_tc with 1 and 2 accumulators against pg_compute_rows (CUDA cores, fp32) on one page of
// pseudo-random weights and nc rows: the largest |difference| relative to the largest |output|, into err[0..1].
__global__ void check_rows(int nr, int nc, int K, float* err) {
    for (int i = threadIdx.x; i < (PAGE + ROWS_X) / 2; i += blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u;
        h ^= h >> 13;
        reinterpret_cast<unsigned short*>(smem)[i] = (unsigned short)(0x3c00u + (h & 0x3ffu)) ^ ((h >> 10) & 1u ? 0x8000u : 0u);
    }
    __syncthreads();
    if (threadIdx.x >= 32) return;
    __shared__ float ref[16 * 16], got[2][16 * 16];
    const __nv_bfloat16* Wp = reinterpret_cast<const __nv_bfloat16*>(smem);
    const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(smem + PAGE);
    const auto xrow = [&](int i) { return x + (size_t)i * K; };
    pg_compute_rows(Wp, nr, nc, K, xrow, ref, 16);
    pg_compute_rows_tc<decltype(xrow), 1>(Wp, nr, nc, K, xrow, got[0], 16);
    pg_compute_rows_tc<decltype(xrow), 2>(Wp, nr, nc, K, xrow, got[1], 16);
    __syncwarp();
    if (threadIdx.x == 0) {
        for (int v = 0; v < 2; v++) {
            float mx = 0.f, d = 0.f;
            for (int i = 0; i < nc; i++)
                for (int r = 0; r < nr; r++) {
                    mx = fmaxf(mx, fabsf(ref[i * 16 + r]));
                    d = fmaxf(d, fabsf(ref[i * 16 + r] - got[v][i * 16 + r]));
                }
            err[v] = d / fmaxf(mx, 1e-30f);
        }
    }
}

// ns per page per warp of the slowest warp of any SM (each warp's clock cycles in cyc, `reps` pages each)
double slowest_ns_per_page(const long long* cyc, int sms, int warps, int reps, double ghz) {
    std::vector<long long> h((size_t)MAXW * sms);
    CK(cudaMemcpy(h.data(), cyc, sizeof(long long) * MAXW * sms, cudaMemcpyDeviceToHost));
    double mx = 0;
    for (int b = 0; b < sms; b++)
        for (int w = 0; w < warps; w++) mx = h[b * MAXW + w] > mx ? h[b * MAXW + w] : mx;
    return mx / reps / ghz;
}

template <int V, int RMAX>
void run(const char* name, int warps, int nr, int K, int sms, long long* cyc, float* sink, double ghz) {
    const int reps = 200, smem_bytes = MAXW * PAGE + 8192;
    CK(cudaFuncSetAttribute(bench<V, RMAX>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    bench<V, RMAX><<<sms, 512, smem_bytes>>>(warps, nr, K, reps, cyc, sink);
    CK(cudaDeviceSynchronize());
    const double ns_page = slowest_ns_per_page(cyc, sms, warps, reps, ghz);
    const double gbs = (double)warps * nr * K * 2 / ns_page;      // bytes per ns = GB/s, per SM
    printf("%-6s rows %2d x K %4d, %2d warps: %7.0f ns per page per warp, %6.1f GB/s per SM\n", name, nr, K, warps,
           ns_page, gbs);
}

template <int ACC>
void run_rows(int warps, int nr, int nc, int K, int sms, long long* cyc, float* sink, double ghz) {
    const int reps = 200, smem_bytes = ROWS_W * PAGE + ROWS_X;
    CK(cudaFuncSetAttribute(bench_rows<ACC>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    bench_rows<ACC><<<sms, 512, smem_bytes>>>(warps, nr, nc, K, reps, cyc, sink);
    CK(cudaDeviceSynchronize());
    const double ns_page = slowest_ns_per_page(cyc, sms, warps, reps, ghz);
    const double gbs = (double)warps * nr * K * 2 / ns_page;
    printf("tc%d    rows %2d x K %4d, %2d inputs, %2d warps: %7.0f ns per page per warp, %6.1f GB/s per SM\n", ACC, nr,
           K, nc, warps, ns_page, gbs);
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
    CK(cudaMalloc(&err, 8));
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
    // the rows part: b8 and b16 gate/up pages (4 rows of 2048), down pages (10 of 768)
    auto chk_rows = [&](int nr, int nc, int K) {
        CK(cudaFuncSetAttribute(check_rows, cudaFuncAttributeMaxDynamicSharedMemorySize, PAGE + ROWS_X));
        check_rows<<<1, 64, PAGE + ROWS_X>>>(nr, nc, K, err);
        CK(cudaDeviceSynchronize());
        float e[2] = {0.f, 0.f};
        CK(cudaMemcpy(e, err, 8, cudaMemcpyDeviceToHost));
        printf("check rows %2d x K %4d, %2d inputs: max |tc - pg_compute_rows| / max |out| = %.2e (tc1), %.2e (tc2)\n",
               nr, K, nc, e[0], e[1]);
    };
    chk_rows(4, 8, 2048);
    chk_rows(4, 16, 2048);
    chk_rows(10, 8, 768);
    chk_rows(10, 16, 768);
    chk_rows(3, 5, 2048);
    const int rws[] = {1, 4, ROWS_W};
    for (int w : rws) {
        for (int nc : {8, 16}) {
            run_rows<1>(w, 4, nc, 2048, sms, cyc, sink, ghz);
            run_rows<2>(w, 4, nc, 2048, sms, cyc, sink, ghz);
            run_rows<1>(w, 10, nc, 768, sms, cyc, sink, ghz);
            run_rows<2>(w, 10, nc, 768, sms, cyc, sink, ghz);
        }
    }
    return 0;
}
