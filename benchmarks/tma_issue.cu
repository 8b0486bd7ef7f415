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
//   /tmp/tma_issue            (everything)
//   /tmp/tma_issue layouts    (the ring alone, per address layout and item size)
// benchmarks/tma_issue_json.py turns either output into the results JSON.
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
// order (`ooo` 1: it polls every slot with test_wait and refills whichever landed: no head-of-line blocking). The
// pages come in items of `item` pages (the kernel's work item: one expert's rows), laid out by `layout`:
//   CONTIG   each block's pages lie contiguously, in sequence;
//   SCATTER  each item at a pseudo-random item-sized slot of the 8 GB buffer (a new 2 MB page at nearly every item,
//            as the step's routed experts and pg_stream's queue);
//   LOCAL    the block's own contiguous run, but its items visited in a shuffled order within each 16-item window
//            (2 MB of 8-page items at 16 KB pages; the same bytes as CONTIG, out of sequence: order or distance?);
//   GAP      items in sequence with one unread item between them (sequential, not contiguous);
//   SPLIT    each item's first half at one pseudo-random slot, its second half at another (an expert's gate and up
//            rows, which the host layout keeps in two regions); `item` even.
// (SCATTER's hash, mix_slot, mixes more than session 41-43's did: other slots, the same spread.)
// `warm` != 0 (SCATTER only): at each item's first page the thread also prefetches the first line of the item |warm|
// items ahead into L2, so its address translation is done before its copies are issued (session 41: a scattered item
// costs the in-order ring ~2 us more than a contiguous one, whatever its page size; whether that is the TLB): by the
// copy engine (cp.async.bulk.prefetch, 16 bytes; warm > 0) or by the load path (prefetch.global.L2; warm < 0), which
// may translate through different TLBs. Session 43: it is not (warming does not help).
enum Layout { CONTIG, SCATTER, LOCAL, GAP, SPLIT, N_LAYOUTS };
static const char* const LAYOUT_NAMES[N_LAYOUTS] = {"contiguous", "scattered", "local", "gap", "split"};

__device__ __forceinline__ size_t mix_slot(unsigned a, unsigned b, size_t slots) {
    unsigned h = (a * 7919u + b) * 2654435761u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    return (size_t)h % slots;
}

__global__ void __launch_bounds__(NT, 1) ring(const char* buf, int n, int bytes, int ooo, int layout, int item,
                                              int warm) {
    __shared__ __align__(8) unsigned long long bar[MAXN];
    if (threadIdx.x != 0) return;
    for (int i = 0; i < MAXN; i++) mbar_init(&bar[i], 1);
    fence_mbar_init();
    const unsigned long long pol = l2_evict_first();
    const int pages = ROUNDS * MAXN;
    const size_t item_bytes = (size_t)item * bytes, run = (size_t)pages * bytes;
    const auto src = [&](int k) -> const char* {
        const int it = k / item, pg = k % item;
        const size_t base = (size_t)blockIdx.x * run;
        switch (layout) {
        case SCATTER:
            return buf + mix_slot(blockIdx.x, (unsigned)it, BUFFER / item_bytes) * item_bytes + (size_t)pg * bytes;
        case LOCAL: {                           // a permutation of each window of 16 items (the last may be short:
            const int items = (pages + item - 1) / item, window = it / 16;   // its own items), x * mult + b mod w
            const int w = min(16, items - window * 16), mult = w % 7 == 0 ? 5 : 7;   // (mult coprime with w)
            const int j = (it % 16 * mult + (int)blockIdx.x) % w;
            return buf + (base + ((size_t)window * 16 + j) * item_bytes + (size_t)pg * bytes) % BUFFER;
        }
        case GAP:
            return buf + (2 * base + 2 * (size_t)it * item_bytes + (size_t)pg * bytes) % BUFFER;
        case SPLIT: {
            const size_t half = item_bytes / 2;
            const int side = pg * 2 >= item;
            return buf + mix_slot(blockIdx.x * 2u + side, (unsigned)it, BUFFER / half) * half +
                   (size_t)(pg - side * item / 2) * bytes;
        }
        default:
            return buf + (base + (size_t)k * bytes) % BUFFER;
        }
    };
    const auto issue = [&](int k, int r) {
        const int ahead = warm < 0 ? -warm : warm;
        if (warm && k % item == 0 && k + item * ahead < pages) {
            if (warm > 0) l2_prefetch_bulk(src(k + item * ahead), 16, pol);
            else asm volatile("prefetch.global.L2 [%0];" ::"l"(src(k + item * ahead)) : "memory");
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

// One ring configuration's per-SM rate (GB/s): the best of 3 launches after a warm-up.
static double ring_rate(const char* buf, int grid, int n, int bytes, int ooo, int layout, int item, int warm,
                        cudaEvent_t e0, cudaEvent_t e1) {
    float best = 1e30f;
    for (int rep = 0; rep < 4; rep++) {
        CK(cudaEventRecord(e0));
        ring<<<grid, NT, SLOTS_BYTES>>>(buf, n, bytes, ooo, layout, item, warm);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        float ms = 0.f;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (rep > 0 && ms < best) best = ms;
    }
    return (double)ROUNDS * MAXN * bytes / (best * 1e-3) / 1e9;
}

// `tma_issue layouts`: the ring alone, per layout and item size (session 44's question: what a scattered item costs
// the in-order ring, if not its translation). Per grid, page size and order: contiguous, local, gap, then
// scattered and split items of 2, 4, 8, 16 pages.
static void layouts_study(const char* buf, int sms, cudaEvent_t e0, cudaEvent_t e1) {
    printf("# layouts: %d pages per block through a ring of 192 KB, GB/s per SM (best of 3 after a warm-up)\n",
           ROUNDS * MAXN);
    for (int grid : {sms, 32})
        for (int bytes : {16384, 32768}) {
            const int n = (int)(SLOTS_BYTES / bytes) < MAXN ? (int)(SLOTS_BYTES / bytes) : MAXN;
            for (int ooo : {0, 1}) {
                printf("sms %3d  %2d KB ring of %2d %s:", grid, bytes / 1024, n, ooo ? "any-order" : "in-order ");
                for (int layout : {CONTIG, LOCAL, GAP})
                    printf("  %s %5.1f", LAYOUT_NAMES[layout], ring_rate(buf, grid, n, bytes, ooo, layout, 8, 0, e0, e1));
                for (int layout : {SCATTER, SPLIT})
                    for (int item : {2, 4, 8, 16})
                        printf("  %s%d %5.1f", LAYOUT_NAMES[layout], item,
                               ring_rate(buf, grid, n, bytes, ooo, layout, item, 0, e0, e1));
                printf("\n");
                fflush(stdout);
            }
        }
}

int main(int argc, char** argv) {
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
    if (argc > 1 && !strcmp(argv[1], "layouts")) {
        printf("# %s\n", prop.name);
        layouts_study(buf, prop.multiProcessorCount, e0, e1);
        return 0;
    }
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
                    const double rate = ring_rate(buf, grid, n, bytes, ooo, scatter ? SCATTER : CONTIG, 8, warm, e0, e1);
                    printf("  %s %s%s %5.1f", scatter ? "scattered" : "contiguous", ooo ? "any-order" : "in-order",
                           warm > 0 ? (warm == 1 ? " tma-warm1" : " tma-warm2")
                                    : warm < 0 ? (warm == -1 ? " lsu-warm1" : " lsu-warm2") : "",
                           rate);
                }
                printf("\n");
                fflush(stdout);
            }
    return 0;
}
