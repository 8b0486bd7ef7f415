// Microbenchmark: how much HBM read bandwidth N streaming SMs get, by the KB each keeps in flight.
// In the b1 trace the MoE phase streams on ~88 of 132 SMs (the others run attention, combines and QKV tails) at
// ~20-29 GB/s per SM, ~2.3 TB/s in all, with ~190 KB in flight per worker. mem_latency.cu measured all SMs at
// 4.62 TB/s from 64 KB in flight each. This says whether 88 SMs can pull HBM's peak at all (then the worker loses
// bandwidth inside itself), or whether the phase needs more SMs streaming.
// Two patterns, both 16 KB bulk copies (TMA) into a ring of `kb` / 16 stages on one warp's lane 0, evict-first:
//   own:   block b streams its own contiguous slice (mem_latency's pattern);
//   queue: blocks claim 128 KB items of one 72 MB region by atomicAdd on a global counter (the MoE worker's
//          queue: 8 experts' gate/up weights) and stream each item's 8 pages, claiming the next item just after
//          issuing the current one's last page;
//   far:   the same queue, but item i lies at a pseudo-random 128 KB slot of a `region` GB buffer (the step's
//          weights are spread over ~60 GB: each layer's experts are elsewhere), to see what address translation
//          costs when every few items touch a new 2 MB page;
//   mix:   8 "experts" of 9 MB, 5 GB apart; one global counter, items expert-major (consecutive claims by one
//          SM land in different experts, as in the step's queue);
//   grp:   the same experts, but SM b claims from expert b % 8's own counter (an SM's consecutive items adjacent).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/sm_stream.cu -o /tmp/sm_stream
//   /tmp/sm_stream
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include "../megakernel/kernel/csrc/mk_async.cuh"   // mbar_*, bulk_load, l2_evict_first

constexpr int NT = 64;
constexpr int CHUNK = 16384;
constexpr int MAX_STAGES = 13;
constexpr size_t OWN_BYTES = 4ull << 30;
constexpr size_t FAR_MAX = 48ull << 30;
constexpr size_t ITEM = 128 * 1024;
constexpr size_t QUEUE_BYTES = 72ull << 20;      // 576 items
constexpr int PASSES = 16;                        // the queue's region read this many times per launch

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

// one 16 KB page: its bytes expected on b, then the bulk copy (the kernel's helpers, mk_async.cuh)
__device__ __forceinline__ void bulk(void* dst, const void* src, unsigned long long* b, unsigned long long pol) {
    mbar_expect_tx(b, CHUNK);
    bulk_load(dst, src, CHUNK, b, pol);
}

extern __shared__ __align__(128) unsigned char smem[];

// Blocks < n_stream, lane 0 of warp 0: `own` streams per_block bytes of its own slice; `queue` claims items until
// the queue's PASSES passes are handed out.
__global__ void __launch_bounds__(NT, 1) streamk(const char* src, int n_stream, int kb, int queue,
                                                 size_t per_block, int* head, unsigned long long* total,
                                                 unsigned long long far_slots, int experts) {
    if (blockIdx.x >= n_stream || threadIdx.x != 0) return;
    const int stages = kb / (CHUNK / 1024);
    __shared__ __align__(8) unsigned long long bar[MAX_STAGES];
    for (int s = 0; s < stages; s++) mbar_init(&bar[s], 1);
    fence_mbar_init();
    const unsigned long long pol = l2_evict_first();
    const int n_items = (int)(QUEUE_BYTES / ITEM) * PASSES, pages_per_item = (int)(ITEM / CHUNK);
    const size_t slice = (OWN_BYTES / gridDim.x) / CHUNK * CHUNK;
    const char* own = src + (size_t)blockIdx.x * slice;
    // the page sequence: page k of this block's stream
    // experts == 1: 8 experts, one counter; 2: one counter per expert (SM b claims from expert b % 8)
    const int grp = blockIdx.x % 8;
    int* hd = experts == 2 ? head + 32 * grp : head;
    const int lim = experts == 2 ? n_items / 8 : n_items;
    int item = queue ? atomicAdd(hd, 1) : 0, pg = 0;
    size_t off = 0, done = 0;
    unsigned phase = 0;
    unsigned long long n = 0;
    int issued = 0;
    auto next_src = [&](const char*& p) -> bool {   // the next page's address, false at the end
        if (!queue) {
            if (done >= per_block) return false;
            p = own + off;
            off = (off + CHUNK) % slice;
            done += CHUNK;
            return true;
        }
        if (item >= lim) return false;
        size_t slot = (size_t)(item % (int)(QUEUE_BYTES / ITEM));
        if (experts) {                                 // 72 items (9 MB) per expert, experts 5 GB apart
            const int e = experts == 2 ? grp : (item / 72) % 8, k = item % 72;
            p = src + (size_t)e * (5ull << 30) + (size_t)k * ITEM + (size_t)pg * CHUNK;
            if (++pg == pages_per_item) { pg = 0; item = atomicAdd(hd, 1); }
            return true;
        }
        if (far_slots) {                               // a pseudo-random slot of the far region
            unsigned long long h = (unsigned long long)item * 0x9E3779B97F4A7C15ull;
            h ^= h >> 29;
            slot = (size_t)(h % far_slots);
        }
        p = src + slot * ITEM + (size_t)pg * CHUNK;
        if (++pg == pages_per_item) { pg = 0; item = atomicAdd(hd, 1); }
        return true;
    };
    for (int s = 0; s < stages; s++) {
        const char* p;
        if (!next_src(p)) break;
        bulk(smem + (size_t)s * CHUNK, p, &bar[s], pol);
        issued++;
    }
    for (int k = 0; k < issued; k++) {
        const int s = k % stages;
        mbar_wait(&bar[s], (phase >> s) & 1);
        phase ^= 1u << s;
        n++;
        const char* p;
        if (next_src(p)) { bulk(smem + (size_t)s * CHUNK, p, &bar[s], pol); issued++; }
    }
    atomicAdd(total, n * CHUNK);
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    char* src;
    int* head;
    unsigned long long* total;
    size_t far_bytes = FAR_MAX;
    while (cudaMalloc(&src, far_bytes) != cudaSuccess) { cudaGetLastError(); far_bytes /= 2; }
    CK(cudaMemset(src, 1, far_bytes));
    CK(cudaMalloc(&head, 4 * 32 * 8));
    CK(cudaMalloc(&total, 8));
    const int smem_bytes = MAX_STAGES * CHUNK;
    CK(cudaFuncSetAttribute(streamk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    printf("# %s, %d SMs; 16 KB bulk copies, evict-first; own: each SM its slice, queue: 128 KB items claimed by "
           "atomicAdd from a 72 MB region\n", prop.name, sms);
    printf("%-6s %5s %5s %10s %10s\n", "pattern", "sms", "kb", "GB/s", "GB/s/SM");
    const int ns[] = {22, 44, 66, 88, 110, 132};
    const int kbs[] = {32, 64, 128, 192};
    const size_t fars[] = {1ull << 30, 8ull << 30, 48ull << 30};
    for (int queue = 0; queue < 2 + 3 + 2; queue++)
        for (int n : ns)
            for (int kb : kbs) {
                if (n > sms) continue;
                const size_t far = queue >= 2 && queue < 5 ? fars[queue - 2] : 0;
                const int experts = queue >= 5 ? queue - 4 : 0;
                if (far > far_bytes || (experts && far_bytes < (40ull << 30))) continue;
                if ((queue >= 2 || getenv("SM_STREAM_SHORT")) && (kb == 32 || kb == 128 || (n != 88 && n != 132))) continue;
                const size_t per_block = (size_t)(1024ull << 20) / n / CHUNK * CHUNK;    // 1 GB in all
                for (int rep = 0; rep < 2; rep++) {               // (the first launch warms up)
                    CK(cudaMemset(head, 0, 4 * 32 * 8));
                    CK(cudaMemset(total, 0, 8));
                    CK(cudaEventRecord(e0));
                    streamk<<<sms, NT, smem_bytes>>>(src, n, kb, queue ? 1 : 0, per_block, head, total,
                                                     far / ITEM, experts);
                    CK(cudaEventRecord(e1));
                    CK(cudaEventSynchronize(e1));
                    CK(cudaGetLastError());
                    if (rep == 0) continue;
                    unsigned long long t = 0;
                    float ms = 0.f;
                    CK(cudaMemcpy(&t, total, 8, cudaMemcpyDeviceToHost));
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    const double gbs = t / (ms * 1e-3) / 1e9;
                    char name[32];
                    if (queue >= 2) snprintf(name, sizeof name, "far%zuG", far >> 30);
                    if (experts) snprintf(name, sizeof name, experts == 1 ? "mix" : "grp");
                    printf("%-7s %5d %5d %10.1f %10.2f\n", queue >= 2 ? name : queue ? "queue" : "own", n, kb, gbs,
                           gbs / n);
                    fflush(stdout);
                }
            }
    return 0;
}
