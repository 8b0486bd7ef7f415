// Microbenchmark: do an SM's bulk copies overlap when one thread issues them back to back?
// Why: the paged MoE worker's loader (lane 0 of one warp, csrc/mk_moe_pages.cuh) streams ~31 GB/s per SM with 16 KB
// pages and nothing else to do (pg_stream.cu, loads only), 17.8 with 8 KB pages and 51.5 with 32 KB, at 32 SMs as at
// 132: ~0.40 us per copy plus ~7.5 ns per KB, whatever the ring's depth (sm_stream.cu: no gain past 64 KB in flight).
// The same ring with each lane issuing its own pages (MK_PG_MULTI_ISSUE's form) streams 65.7. The instructions of the
// lane-0 loop take ~0.05 us a page (SASS), so either one thread's copies are served one after another (each waiting
// for the one before it to land), or something else in the loop waits. Here every block issues a burst of `n`
// copies of `bytes` each from fresh HBM addresses into n shared-memory slots (one mbarrier each), waits for all of
// them, and repeats; thread 0 times each burst (%globaltimer). The modes:
//   serial   lane 0 issues a copy and waits for it before the next: n x one copy's latency;
//   thread   lane 0 issues all n back to back, then waits (the loader's lane-0 loop when every slot is free);
//   lanes2/4 lanes 0..1 (0..3) of one warp each issue their share back to back (a loader with 2 / 4 issuing lanes);
//   lanes    lane i of one warp issues copy i (one instruction for the burst: MK_PG_MULTI_ISSUE);
//   warps    lane 0 of warp i issues copy i (n warps);
//   tensor   as thread, by 2D tensor copies (cp.async.bulk.tensor, a [rows, 256] bf16 view, boxes of 256 x
//            bytes / 512) instead of 1D bulk copies (cp.async.bulk): whether the tensor path serves one thread's
//            copies differently.
// If `thread` takes ~n x `serial` and `lanes` / `warps` ~one latency, an SM serves one thread's copies in order, one
// at a time, and the loader should issue from several lanes; if `thread` ~ `lanes`, the lane-0 loop's cost is
// elsewhere (its waits). Prints, per grid (all SMs, 32) and copy size (8, 16, 32 KB), each mode's burst time (us) and
// per-SM rate for n = 1, 2, 4, 8, 12 (n x bytes <= 192 KB). Then the ring (below): whether the in-order refill or the
// addresses hold a one-thread ring below the burst's rate.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/tma_issue.cu -o /tmp/tma_issue
//   /tmp/tma_issue
#include <cstdio>
#include <cstdlib>
#include <cuda.h>
#include <cuda_runtime.h>
#include "../megakernel/kernel/csrc/mk_async.cuh"   // mbar_*, bulk_load, bulk_tensor_2d, l2_evict_first: the kernel's
                                                    // copy path
#include "../megakernel/kernel/csrc/mk_tmap.h"      // mk_tmap_encoder: the driver's tensor-map encoder

constexpr int NT = 512, MAXN = 12, ROUNDS = 48;
constexpr size_t SLOTS_BYTES = 192 * 1024, BUFFER = 8ull << 30;
enum Mode { SERIAL, THREAD, LANES2, LANES4, LANES, WARPS, TENSOR, N_MODES };
static const char* const MODE_NAMES[N_MODES] = {"serial", "thread", "lanes2", "lanes4", "lanes", "warps", "tensor"};

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

extern __shared__ __align__(1024) unsigned char smem[];

__device__ __forceinline__ unsigned long long gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// A bounded spin (a protocol bug traps instead of hanging the device).
__device__ __forceinline__ void wait_phase(unsigned long long* bar, unsigned parity) {
    const long long t0 = clock64();
    while (!mbar_try_wait(bar, parity))
        if (clock64() - t0 > 4000000000ll) __trap();
}

__global__ void __launch_bounds__(NT, 1) burst(const char* buf, const __grid_constant__ CUtensorMap map, int mode,
                                               int n, int bytes, int launch, unsigned long long* ns_out) {
    __shared__ __align__(8) unsigned long long bar[MAXN];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        for (int i = 0; i < MAXN; i++) mbar_init(&bar[i], 1);
        fence_mbar_init();
    }
    __syncthreads();
    const unsigned long long pol = l2_evict_first();
    unsigned long long total = 0;
    for (int r = 0; r < ROUNDS; r++) {
        const unsigned parity = (unsigned)r & 1u;
        // copy i of this round: a fresh address (no L2 hits), the same sequence for every mode
        // (`launch`: each launch its own addresses, so a repetition's small bursts do not hit the last one's lines)
        const size_t first = (((size_t)launch * gridDim.x + blockIdx.x) * ROUNDS + r) * MAXN;
        const auto src_off = [&](int i) { return ((first + i) * (size_t)bytes) % BUFFER; };
        const auto issue = [&](int i) {
            mbar_expect_tx(&bar[i], (unsigned)bytes);
            if (mode == TENSOR)
                bulk_tensor_2d(smem + (size_t)i * bytes, &map, 0, (int)(src_off(i) / 512), &bar[i], pol);
            else
                bulk_load(smem + (size_t)i * bytes, buf + src_off(i), (unsigned)bytes, &bar[i], pol);
        };
        __syncthreads();
        const unsigned long long t0 = gtimer();
        if (mode == SERIAL) {
            if (threadIdx.x == 0)
                for (int i = 0; i < n; i++) { issue(i); wait_phase(&bar[i], parity); }
        } else if (mode == THREAD || mode == TENSOR) {
            if (threadIdx.x == 0)
                for (int i = 0; i < n; i++) issue(i);
        } else if (mode == LANES2 || mode == LANES4) {
            const int k = mode == LANES2 ? 2 : 4;
            if (warp == 0 && lane < k)
                for (int i = lane; i < n; i += k) issue(i);
        } else if (mode == LANES) {
            if (warp == 0 && lane < n) issue(lane);
        } else {                                   // WARPS
            if (warp < n && lane == 0) issue(warp);
        }
        if (threadIdx.x == 0) {
            for (int i = 0; i < n; i++) wait_phase(&bar[i], parity);
            total += gtimer() - t0;
        }
    }
    if (threadIdx.x == 0) ns_out[blockIdx.x] = total;
}


// The ring's steady state (pg_stream.cu's loader without its consumers), on this file's addresses: thread 0 streams
// ROUNDS x MAXN pages of `bytes` through `n` slots, refilling each slot once its copy landed, in sequence order
// (`ooo` 0: it waits for the oldest copy, as the kernel's loader waits for the oldest page's `empty`) or in landing
// order (`ooo` 1: it polls every slot with test_wait and refills whichever landed: no head-of-line blocking). Pages
// lie contiguously per block (`scatter` 0) or in 128 KB items of 8 pages (16 KB) at pseudo-random 128 KB slots of the
// buffer (`scatter` 1: a new 2 MB page at nearly every item, as the step's routed experts and pg_stream's queue).
// `warm` != 0: at each item's first page the thread also prefetches the first line of the item |warm| items ahead into
// L2, so its address translation is done before its copies are issued (session 41: a scattered item costs the
// in-order ring ~2 us more than a contiguous one, whatever its page size; whether that is the TLB): by the copy
// engine (cp.async.bulk.prefetch, 16 bytes; warm > 0) or by the load path (prefetch.global.L2; warm < 0), which may
// translate through different TLBs.
__global__ void __launch_bounds__(NT, 1) ring(const char* buf, int n, int bytes, int ooo, int scatter, int warm) {
    __shared__ __align__(8) unsigned long long bar[MAXN];
    if (threadIdx.x != 0) return;
    for (int i = 0; i < MAXN; i++) mbar_init(&bar[i], 1);
    fence_mbar_init();
    const unsigned long long pol = l2_evict_first();
    const int pages = ROUNDS * MAXN;
    const size_t item_bytes = 8 * (size_t)bytes;
    const auto src = [&](int k) -> const char* {
        if (!scatter) return buf + (((size_t)blockIdx.x * pages + k) * bytes) % BUFFER;
        unsigned h = (unsigned)(blockIdx.x * 7919 + (k / 8)) * 2654435761u;
        h ^= h >> 15;
        const size_t slot = (size_t)h % (BUFFER / item_bytes);
        return buf + slot * item_bytes + (size_t)(k % 8) * bytes;
    };
    const auto issue = [&](int k, int r) {
        const int ahead = warm < 0 ? -warm : warm;
        if (warm && k % 8 == 0 && k + 8 * ahead < pages) {
            if (warm > 0) l2_prefetch_bulk(src(k + 8 * ahead), 16, pol);
            else asm volatile("prefetch.global.L2 [%0];" ::"l"(src(k + 8 * ahead)) : "memory");
        }
        mbar_expect_tx(&bar[r], (unsigned)bytes);
        bulk_load(smem + (size_t)r * bytes, src(k), (unsigned)bytes, &bar[r], pol);
    };
    if (!ooo) {
        for (int k = 0; k < pages; k++) {
            const int r = k % n;
            if (k >= n) wait_phase(&bar[r], (unsigned)((k / n) - 1) & 1u);
            issue(k, r);
        }
        for (int k = pages; k < pages + n; k++) wait_phase(&bar[k % n], (unsigned)((k / n) - 1) & 1u);
    } else {
        unsigned ph = 0;                       // bit r: the parity slot r's copy in flight completes
        int next = 0, landed = 0;
        for (; next < n; next++) issue(next, next);
        const long long t0 = clock64();
        while (landed < pages) {
            for (int r = 0; r < n; r++) {
                if (!mbar_test_wait(&bar[r], (ph >> r) & 1u)) continue;
                ph ^= 1u << r;
                landed++;
                if (next < pages) issue(next++, r);
            }
            if (clock64() - t0 > 4000000000ll) __trap();
        }
    }
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    char* buf;
    CK(cudaMalloc(&buf, BUFFER));
    CK(cudaMemset(buf, 0x3c, BUFFER));
    unsigned long long* ns;
    CK(cudaMalloc(&ns, sizeof(unsigned long long) * prop.multiProcessorCount));
    CK(cudaFuncSetAttribute(burst, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SLOTS_BYTES));
    CK(cudaFuncSetAttribute(ring, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SLOTS_BYTES));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    printf("# %s; %d rounds per launch, bursts of n copies per block from fresh HBM addresses, the best of 3 launches "
           "after a warm-up; us: thread 0's mean burst time; GB/s per SM: n x bytes / that\n", prop.name, ROUNDS);
    const int grids[] = {prop.multiProcessorCount, 32};
    int launch = 0;
    const int sizes[] = {8192, 16384, 32768};
    const int ns_list[] = {1, 2, 4, 8, 12};
    for (int grid : grids)
        for (int bytes : sizes) {
            // the tensor view: rows of 256 bf16 (512 B), boxes of bytes / 512 rows, no swizzle (the slot's image
            // is the same contiguous bytes as the 1D copy's)
            CUtensorMap map;
            memset(&map, 0, sizeof(map));
            bool have_map = false;
            if (MkEncodeTiled fn = mk_tmap_encoder()) {
                const cuuint64_t dims[2] = {256, BUFFER / 512};
                const cuuint64_t strides[1] = {512};
                const cuuint32_t box[2] = {256, (cuuint32_t)(bytes / 512)};
                const cuuint32_t estr[2] = {1, 1};
                memset(&map, 0, sizeof(map));
                const CUresult r = fn(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, buf, dims, strides, box, estr,
                                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
                have_map = r == CUDA_SUCCESS;
                if (!have_map) printf("# tensor map for %d-byte boxes: encode failed (%d); tensor mode skipped\n", bytes, (int)r);
            }
            for (int n : ns_list) {
                if ((size_t)n * bytes > SLOTS_BYTES) continue;
                printf("sms %3d  %2d KB x %2d:", grid, bytes / 1024, n);
                for (int mode = 0; mode < N_MODES; mode++) {
                    if (mode == TENSOR && !have_map) continue;
                    if (mode == WARPS && n > NT / 32) continue;
                    double best = 1e30;
                    for (int rep = 0; rep < 4; rep++) {
                        burst<<<grid, NT, SLOTS_BYTES>>>(buf, map, mode, n, bytes, launch++, ns);
                        CK(cudaGetLastError());
                        CK(cudaDeviceSynchronize());
                        unsigned long long h[256];
                        CK(cudaMemcpy(h, ns, sizeof(unsigned long long) * grid, cudaMemcpyDeviceToHost));
                        double sum = 0;
                        for (int b = 0; b < grid; b++) sum += (double)h[b];
                        const double us = sum / grid / ROUNDS / 1e3;
                        if (rep > 0 && us < best) best = us;
                    }
                    printf("  %s %6.2f us %5.1f", MODE_NAMES[mode], best, (double)n * bytes / (best * 1e-6) / 1e9);
                }
                printf("\n");
                fflush(stdout);
            }
        }
    // the ring: per grid, copy size and depth, in order against in landing order, contiguous against scattered
    printf("# ring: %d pages per block through n slots, GB/s per SM from the launch's time (best of 3 after a "
           "warm-up)\n", ROUNDS * MAXN);
    for (int grid : grids)
        for (int bytes : sizes)
            for (int n : {4, 8, 12}) {
                if ((size_t)n * bytes > SLOTS_BYTES) continue;
                printf("sms %3d  %2d KB ring of %2d:", grid, bytes / 1024, n);
                // (scatter, refill in landing order, warm-up items ahead)
                const int variants[][3] = {{0, 0, 0}, {0, 1, 0}, {1, 0, 0}, {1, 1, 0}, {1, 0, 1}, {1, 0, 2}, {1, 0, -1},
                                             {1, 0, -2}, {1, 1, 1}};
                for (const auto& v : variants) {
                    const int scatter = v[0], ooo = v[1], warm = v[2];
                    float best = 1e30f;
                    for (int rep = 0; rep < 4; rep++) {
                        CK(cudaEventRecord(e0));
                        ring<<<grid, NT, SLOTS_BYTES>>>(buf, n, bytes, ooo, scatter, warm);
                        CK(cudaEventRecord(e1));
                        CK(cudaEventSynchronize(e1));
                        CK(cudaGetLastError());
                        float ms = 0.f;
                        CK(cudaEventElapsedTime(&ms, e0, e1));
                        if (rep > 0 && ms < best) best = ms;
                    }
                    printf("  %s %s%s %5.1f", scatter ? "scattered" : "contiguous", ooo ? "any-order" : "in-order",
                           warm > 0 ? (warm == 1 ? " tma-warm1" : " tma-warm2")
                                    : warm < 0 ? (warm == -1 ? " lsu-warm1" : " lsu-warm2") : "",
                           (double)ROUNDS * MAXN * bytes / (best * 1e-3) / 1e9);
                }
                printf("\n");
                fflush(stdout);
            }
    return 0;
}
