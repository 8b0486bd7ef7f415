// Microbenchmark: the paged MoE worker's protocol alone (csrc/mk_moe_pages.cuh), to rank what caps its delivery.
// Why: in the b1 8K trace every paged worker streams 23-26 GB/s (~3.3 TB/s over 132 SMs) and its computing warps
// wait ~5 us for each page, while each page lands ~1.2 us after its copy is issued: the loader issues late, ~3.3 us
// per item outside its ring waits (SPEED_NOTES, twenty-first session). sm_stream.cu's bare queue of the same 128 KB
// items reaches 33-49 GB/s per SM. The candidates are build switches, each a full kernel build and an A/B on the
// device; this kernel has the worker's shape with each candidate as a runtime knob, so one run ranks them all (the
// kernel switches named below were measured in session 24 and the losing ones removed in session 26; the modes stay;
// `kernel_now` below is the default build's worker as of session 35):
//   - one loader lane (warp 15) claims 128 KB gate/up items by atomicAdd on a global head, `lead` pages before the
//     current item's end (inside the page loop, or between two loops: `split`), with `ahead` (1 or 2) claims, publishes each in one of 3 item slots once the
//     slot's previous item is freed, and streams its 8 pages (4 gate + 4 up pages of 4 rows of 2048) by 16 KB bulk
//     copies, evict-first, into a ring of `npg` pages (a proxy fence before each copy where `fence`);
//   - computing warp w owns ring page w: waits for it, multiplies its 4 rows by an x row (the kernel's pg_rows,
//     mk_page_math.cuh; skipped where math = 0), frees the page and counts it; the warp that counts an item's last
//     page writes its epilogue (SiLU(gate) * up, 16 bf16 stores), frees its slot and signals the expert's counter by
//     red.release.gpu (where `release`), the signal before the free (the kernel's order) or after it (`free_early`,
//     MK_PG_FREE_EARLY);
//   - the ring starts `offset` bytes past a 1024-aligned shared address (0: mk_decode's ring since MK_SMEM_ALIGN=128
//     became the default in session 24; 32: before, when its dynamic base 3616 was 32 past a 128-byte line).
// Not modelled: the input warp (a gate/up item with shared x rows has no inputs to load), down and O items, other
// task kinds' traffic on the SMs that do not stream. Items lie expert by expert (48 per expert, 8 experts a "layer"),
// each expert at a random 6 MB slot of a 24 GB buffer, as the step's routed experts are spread over its weights.
// Prints GB/s (best of 3 launches after a warm-up, configurations interleaved) over all SMs and over 88 (the MoE
// phase's streaming SMs in earlier traces).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/pg_stream.cu -o /tmp/pg_stream
//   /tmp/pg_stream
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include "../megakernel/kernel/csrc/mk_async.cuh"       // mbar_*, bulk_load, l2_evict_first: the kernel's copy path
#include "../megakernel/kernel/csrc/mk_page_math.cuh"   // pg_rows: the kernel's one-row page product

constexpr int NTHREADS = 512, LOADER = 15;
constexpr int PAGE = 16384, MAXPG = 12, SLOTS = 3, ITEM_PAGES = 8, K = 2048, ROWS = PAGE / (2 * K);
constexpr int EXPERT_ROWS = 768, ITEM_ROWS = ROWS * ITEM_PAGES / 2;             // 16 gate + 16 up rows per item
constexpr int ITEMS_PER_EXPERT = EXPERT_ROWS / ITEM_ROWS;                       // 48
constexpr size_t EXPERT_BYTES = 2ull * EXPERT_ROWS * K * 2;                     // 6 MB of gate/up weights
constexpr size_t BUFFER = 24ull << 30;
constexpr int SLOTS_IN_BUFFER = (int)(BUFFER / EXPERT_BYTES);
constexpr int LAYERS = 48, EXPERTS_PER_LAYER = 8;
constexpr int N_ITEMS = LAYERS * EXPERTS_PER_LAYER * ITEMS_PER_EXPERT;         // 18432 items, 2.42 GB per launch
constexpr int PAD = 2048;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

struct Knobs {
    int sms, npg, lead, ahead, free_early, release, fence, offset, math, split;
};

extern __shared__ __align__(16) unsigned char smem[];

// One thread's bounded spin on a phase (a protocol bug traps instead of hanging the device).
__device__ __forceinline__ void lane_wait(unsigned long long* bar, unsigned parity) {
    const long long t0 = clock64();
    while (!mbar_try_wait(bar, parity))
        if (clock64() - t0 > 4000000000ll) __trap();
}
// Lane 0 spins, then the whole warp observes the phase (as the kernel's pg_wait).
__device__ __forceinline__ void warp_wait(unsigned long long* bar, unsigned parity) {
    if ((threadIdx.x & 31) == 0) lane_wait(bar, parity);
    __syncwarp();
    mbar_wait(bar, parity);
}

__device__ __forceinline__ void red_release_gpu(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__global__ void __launch_bounds__(NTHREADS, 1) worker(const __nv_bfloat16* w, const int* expert_slot, int* head,
                                                       int* counters, __nv_bfloat16* eact, Knobs kn) {
    __shared__ __align__(8) unsigned long long full[MAXPG], empty[MAXPG], free_[SLOTS];
    __shared__ int page_q[MAXPG], page_p[MAXPG], slot_item[SLOTS], done[SLOTS];
    __shared__ float outs[SLOTS][2 * ITEM_ROWS];
    __shared__ __align__(16) __nv_bfloat16 x[K];
    __shared__ int s_slots[N_ITEMS / ITEMS_PER_EXPERT];   // (the kernel's routing table is in shared memory too)
    if (blockIdx.x >= kn.sms) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, npg = kn.npg;
    const unsigned base = smem_addr(smem);
    unsigned char* ring = smem + (((base + 1023u) & ~1023u) - base) + kn.offset;
    for (int i = threadIdx.x; i < K; i += NTHREADS) x[i] = __float2bfloat16(0.001f * (i % 97));
    for (int i = threadIdx.x; i < N_ITEMS / ITEMS_PER_EXPERT; i += NTHREADS) s_slots[i] = expert_slot[i];
    if (threadIdx.x == 0) {
        for (int i = 0; i < npg; i++) { mbar_init(&full[i], 1); mbar_init(&empty[i], 1); }
        for (int q = 0; q < SLOTS; q++) { mbar_init(&free_[q], 1); done[q] = 0; }
        fence_mbar_init();
    }
    __syncthreads();
    if (warp == LOADER) {
        if (lane == 0) {
            const unsigned long long pol = l2_evict_first();
            // (head + 0 through a thread-dependent offset: with a uniform address ptxas aggregates the atomic over
            // the warp and shuffles its result at once, so the claim would wait where it is made; the kernel's
            // claim is a plain ATOM whose result is first read after the item's last page)
            int* const hd = head + (threadIdx.x >> 9);
            int item = atomicAdd(hd, 1), j = 0, s = 0;
            const int claim_at = kn.lead == 0 ? ITEM_PAGES / 2 : kn.lead >= ITEM_PAGES ? 0 : ITEM_PAGES - kn.lead;
            // item j into slot j % SLOTS once free, its pages into the ring; the claim into `claim` on the way.
            // False at the end of the queue.
            const auto run_item = [&](int& claim) -> bool {
                const int q = j % SLOTS;
                if (j >= SLOTS) lane_wait(&free_[q], (unsigned)((j / SLOTS) - 1) & 1u);
                if (item >= N_ITEMS) return false;
                slot_item[q] = item;
                const __nv_bfloat16* e = w + (size_t)s_slots[item / ITEMS_PER_EXPERT] * (EXPERT_BYTES / 2);
                const int r0 = (item % ITEMS_PER_EXPERT) * ITEM_ROWS;
                // page p; the claim inside the page loop (the kernel today: ptxas makes each page's branch around
                // the atomic wait for it, so the claim stalls the next page) or between two loops (split,
                // MK_PG_CLAIM_SPLIT=1)
                const auto page = [&](int p) {
                    const int rs = s % npg;
                    if (s >= npg) lane_wait(&empty[rs], (unsigned)((s / npg) - 1) & 1u);
                    page_q[rs] = q;
                    page_p[rs] = p;
                    // pages 0-3: gate rows r0.., 4-7: up rows (EXPERT_ROWS on) r0..
                    const __nv_bfloat16* src = e + (size_t)((p < 4 ? 0 : EXPERT_ROWS) + r0 + (p & 3) * ROWS) * K;
                    if (kn.fence) fence_proxy_async();
                    mbar_expect_tx(&full[rs], PAGE);
                    bulk_load(ring + (size_t)rs * PAGE, src, PAGE, &full[rs], pol);
                    s++;
                };
                if (kn.split) {
                    for (int p = 0; p < claim_at; p++) page(p);
                    claim = atomicAdd(hd, 1);
                    for (int p = claim_at; p < ITEM_PAGES; p++) page(p);
                } else {
                    for (int p = 0; p < ITEM_PAGES; p++) {
                        if (p == claim_at) claim = atomicAdd(hd, 1);
                        page(p);
                    }
                }
                return true;
            };
            if (kn.ahead == 2) {       // the kernel's MK_PG_CLAIM_AHEAD=2: item j + 2's claim made during item j,
                int ca = atomicAdd(hd, 1), cb = 0;   // into the register read one item later
                while (true) {
                    if (!run_item(cb)) break;
                    item = ca; j++;
                    if (!run_item(ca)) break;
                    item = cb; j++;
                }
            } else {
                while (true) {
                    int nxt = 0;
                    if (!run_item(nxt)) break;
                    item = nxt; j++;
                }
            }
            for (int i = 0; i < npg; i++, s++) {       // an end marker into every computing warp's page
                const int rs = s % npg;
                if (s >= npg) lane_wait(&empty[rs], (unsigned)((s / npg) - 1) & 1u);
                page_q[rs] = -1;
                mbar_arrive(&full[rs]);
            }
        }
        __syncwarp();
    } else if (warp < npg) {
        const __nv_bfloat16* page = reinterpret_cast<const __nv_bfloat16*>(ring + (size_t)warp * PAGE);
        for (int k = 0;; k++) {
            warp_wait(&full[warp], (unsigned)k & 1u);
            const int q = page_q[warp], p = page_p[warp];
            if (q < 0) {
                if (lane == 0) mbar_arrive(&empty[warp]);
                break;
            }
            if (kn.math) pg_rows<ROWS>(page, x, ROWS, K, &outs[q][p * ROWS]);
            __syncwarp();
            int last = 0;
            if (lane == 0) {
                mbar_arrive(&empty[warp]);
                __threadfence_block();                 // this page's outputs before the count
                last = atomicAdd(&done[q], 1) == ITEM_PAGES - 1;
            }
            last = __shfl_sync(0xffffffffu, last, 0);
            if (!last) continue;
            __threadfence_block();                     // every page's outputs after the count
            const int item = slot_item[q];
            if (lane < ITEM_ROWS) {
                const float g = outs[q][lane], u = outs[q][ITEM_ROWS + lane];
                eact[(size_t)item * ITEM_ROWS + lane] = __float2bfloat16(g / (1.f + __expf(-g)) * u);
            }
            __syncwarp();
            int* ctr = counters + item / ITEMS_PER_EXPERT;
            if (lane == 0) {
                if (kn.free_early) { done[q] = 0; mbar_arrive(&free_[q]); }
                if (kn.release) red_release_gpu(ctr, 1);
                if (!kn.free_early) { done[q] = 0; mbar_arrive(&free_[q]); }
            }
            __syncwarp();
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 0; i < npg; i++) { mbar_inval(&full[i]); mbar_inval(&empty[i]); }
        for (int q = 0; q < SLOTS; q++) mbar_inval(&free_[q]);
    }
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    __nv_bfloat16* w;
    CK(cudaMalloc(&w, BUFFER));
    CK(cudaMemset(w, 0x3c, BUFFER));
    // 8 distinct random expert slots per layer, expert by expert through the queue
    std::vector<int> slots(N_ITEMS / ITEMS_PER_EXPERT);
    srand(1234);
    for (int l = 0; l < LAYERS; l++)
        for (int e = 0; e < EXPERTS_PER_LAYER; e++) {
            int v;
            bool again;
            do {
                v = rand() % SLOTS_IN_BUFFER;
                again = false;
                for (int f = 0; f < e; f++) again |= slots[l * EXPERTS_PER_LAYER + f] == v;
            } while (again);
            slots[l * EXPERTS_PER_LAYER + e] = v;
        }
    int *d_slots, *head, *counters;
    __nv_bfloat16* eact;
    CK(cudaMalloc(&d_slots, slots.size() * sizeof(int)));
    CK(cudaMemcpy(d_slots, slots.data(), slots.size() * sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&head, sizeof(int)));
    CK(cudaMalloc(&counters, slots.size() * sizeof(int)));
    CK(cudaMalloc(&eact, (size_t)N_ITEMS * ITEM_ROWS * 2));
    const int smem_bytes = MAXPG * PAGE + PAD;
    CK(cudaFuncSetAttribute(worker, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    //                      sms npg lead ahead free_early release fence offset math split
    const Knobs kernel_now = {0, 12, 4, 1, 0, 1, 0, 0, 1, 1};   // the default build's worker at b1 (session 35)
    struct Config { const char* name; Knobs k; };
    std::vector<Config> configs;
    auto with = [&](const char* name, auto f) { Knobs k = kernel_now; f(k); configs.push_back({name, k}); };
    with("kernel today (offset 0, split claim, no per-page fence)", [](Knobs&) {});
    with("offset 32 (before MK_SMEM_ALIGN=128)", [](Knobs& k) { k.offset = 32; });
    with("a proxy fence per page (MK_PG_PROXY_FENCE=1)", [](Knobs& k) { k.fence = 1; });
    with("claim inside the page loop (before session 26)", [](Knobs& k) { k.split = 0; });
    with("ahead 2 (MK_PG_CLAIM_AHEAD=2, removed)", [](Knobs& k) { k.ahead = 2; });
    with("free_early (MK_PG_FREE_EARLY=1, removed)", [](Knobs& k) { k.free_early = 1; });
    with("lead 1", [](Knobs& k) { k.lead = 1; });
    with("lead 8 (the claim at the item's start)", [](Knobs& k) { k.lead = 8; });
    with("no release", [](Knobs& k) { k.release = 0; });
    with("no math", [](Knobs& k) { k.math = 0; });
    with("8 pages (128 KB in flight at most)", [](Knobs& k) { k.npg = 8; });
    with("ahead 2 + free_early", [](Knobs& k) { k.ahead = 2; k.free_early = 1; });
    with("loads only (no math, no release)", [](Knobs& k) { k.math = 0; k.release = 0; });
    for (const Config& c : configs)
        if (c.k.npg < 1 || c.k.npg > MAXPG || c.k.offset < 0 || c.k.offset % 16 || c.k.offset + 1024 > PAD
            || c.k.lead < 0 || c.k.ahead < 1 || c.k.ahead > 2) {
            fprintf(stderr, "bad knobs in %s\n", c.name);
            return 1;
        }
    const size_t bytes = (size_t)N_ITEMS * ITEM_PAGES * PAGE;
    printf("# %s; %d items of 128 KB (%.2f GB) per launch from a %zu GB buffer; GB/s best of 3 launches after a "
           "warm-up, configurations interleaved\n", prop.name, N_ITEMS, bytes / 1e9, BUFFER >> 30);
    const int grids[] = {prop.multiProcessorCount, 88};
    for (int grid : grids) {
        std::vector<float> best(configs.size(), 1e30f);
        for (int rep = 0; rep < 4; rep++)
            for (size_t c = 0; c < configs.size(); c++) {
                Knobs k = configs[c].k;
                k.sms = grid;
                CK(cudaMemset(head, 0, sizeof(int)));
                CK(cudaEventRecord(e0));
                worker<<<grid, NTHREADS, smem_bytes>>>(w, d_slots, head, counters, eact, k);
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                CK(cudaGetLastError());
                float ms = 0.f;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                if (rep > 0 && ms < best[c]) best[c] = ms;
            }
        for (size_t c = 0; c < configs.size(); c++)
            printf("sms %3d  %-44s %8.1f GB/s  %6.1f GB/s per SM\n", grid, configs[c].name,
                   bytes / (best[c] * 1e-3) / 1e9, bytes / (best[c] * 1e-3) / 1e9 / grid);
    }
    return 0;
}
