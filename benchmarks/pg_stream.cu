// Microbenchmark: the paged MoE worker's protocol alone (csrc/mk_moe_pages.cuh), to rank what caps its delivery.
// Why: in the b1 8K traces every paged worker streams 22-24 GB/s on the H200 (whose HBM needs ~30 per SM) while its
// computing warps wait ~5.8 us for each page and each page lands ~1 us after its copy is issued: the loader issues
// late (SPEED_NOTES, thirty-fourth session). This kernel has the worker's shape with each candidate as a runtime knob,
// so one run ranks them all; below HBM's limit (the smaller grids, on an H100 too) it shows each form's per-SM cap:
//   - the loader warp (warp 15) claims 128 KB gate/up items by atomicAdd on a global head, `lead` pages before the
//     current item's end (between two page loops, as the kernel), spends `decode_ns` on each item (the kernel's
//     moe_item decode, ~0.75 us in the H200 page stats) before or after (`decode_early`: MK_PG_DECODE_EARLY) the
//     wait for the item's slot (3 slots, each freed by its item's epilogue), and streams its 8 pages (4 gate + 4 up
//     pages of 4 rows of 2048) by 16 KB bulk copies, evict-first, into a ring of `npg` pages, lane 0 one page after
//     another, or (`multi`: MK_PG_MULTI_ISSUE) lane i page i, each lane polling its own ring page (a proxy fence
//     before each copy where `fence`);
//   - computing warp w owns ring page w: waits for it, multiplies its 4 rows by an x row (the kernel's pg_rows,
//     mk_page_math.cuh; skipped where math = 0), frees the page and counts it; the warp that counts an item's last
//     page writes its epilogue (SiLU(gate) * up, 16 bf16 stores), frees its slot and signals the expert's counter by
//     red.release.gpu (where `release`), the signal before the free (the kernel's order) or after it (`free_early`,
//     MK_PG_FREE_EARLY);
//   - the ring starts `offset` bytes past a 1024-aligned shared address (0: mk_decode's ring since MK_SMEM_ALIGN=128).
//   - `page`: the bytes of a ring page and of each bulk copy (16 KB as the kernel; 8 and 32 KB without the math; the
//     32 KB ring of 6 pages keeps 192 KB, the 8 KB ring of 12 pages holds 96 KB, as at most 12 computing warps own a
//     page each): whether the lane-0 loop's cap is a cost per copy issued (then 32 KB pages double it).
// Not modelled: the input warp (a gate/up item with shared x rows has no inputs to load), down and O items, other
// task kinds' traffic on the SMs that do not stream. Items lie expert by expert (48 per expert, 8 experts a "layer"),
// each expert at a random 6 MB slot of a 24 GB buffer, as the step's routed experts are spread over its weights.
// Prints GB/s (best of 3 launches after a warm-up, configurations interleaved) over all SMs, 88, 64 and 32.
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
constexpr int LAYERS = 12, EXPERTS_PER_LAYER = 8;
constexpr int N_ITEMS = LAYERS * EXPERTS_PER_LAYER * ITEMS_PER_EXPERT;         // 4608 items, 0.6 GB at most
constexpr int PAD = 2048;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

struct Knobs {
    int sms, npg, lead, free_early, release, fence, offset, math, multi, decode_ns, decode_early, n_items;
    int page;   // bytes per ring page and per bulk copy (PAGE, or 8 / 32 KB with math = 0: what one copy's issue costs)
    int spin;   // every wait polls with test_wait, else with try_wait (the kernel's form)
    int selfring;   // no computing warps: lane 0 reuses a ring page once its copy landed (its `full` phase), no item
                    // slots: the ring's copies alone, issued one at a time, each slot refilled as soon as it lands
    int contig;     // items in address order (expert e at e x 6 MB) instead of each expert at a random slot of the buffer
    int cwait;      // a computing warp's wait for its page: 0 lane 0 spins, then every lane waits (the kernel's pg_wait);
                    // 1 lane 0 alone, then __syncwarp (whether 32 lanes' waits on one mbarrier cost the SM's barrier
                    // unit what the loader's copies then wait for; loads only, so no lane reads the page)
};

__device__ __forceinline__ unsigned long long gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern __shared__ __align__(16) unsigned char smem[];

// One thread's bounded spin on a phase (a protocol bug traps instead of hanging the device): with try_wait, which
// may suspend the thread until the phase completes or a time limit passes (the kernel's form), or (`spin`) with
// test_wait, which returns at once. Session 40 (H100): no difference at any grid or page size (32 SMs, loads only:
// 31.3 against 31.7 GB/s per SM; 8 KB pages 17.9 / 18.1; 32 KB 51.8 / 51.9), so a late wake from try_wait is not the
// lane-0 loop's cost per copy; the kernel's switch for it (MK_MBAR_SPIN) lost 0.5-1.2% at one row and was removed.
__device__ __forceinline__ bool phase_done(unsigned long long* bar, unsigned parity, bool spin) {
    return spin ? mbar_test_wait(bar, parity) : mbar_try_wait(bar, parity);
}
__device__ __forceinline__ void lane_wait(unsigned long long* bar, unsigned parity, bool spin) {
    const long long t0 = clock64();
    while (!phase_done(bar, parity, spin))
        if (clock64() - t0 > 4000000000ll) __trap();
}
// Lane 0 spins, then the whole warp observes the phase (as the kernel's pg_wait).
__device__ __forceinline__ void warp_wait(unsigned long long* bar, unsigned parity, bool spin) {
    if ((threadIdx.x & 31) == 0) lane_wait(bar, parity, spin);
    __syncwarp();
    while (!phase_done(bar, parity, spin)) {}
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
        const unsigned long long pol = l2_evict_first();
        // (head + 0 through a thread-dependent offset: with a uniform address ptxas aggregates the atomic over the
        // warp and shuffles its result at once, so the claim would wait where it is made; the kernel's claim is a
        // plain ATOM whose result is first read after the item's last page)
        int* const hd = head + (threadIdx.x >> 9);
        int item = 0, j = 0, s = 0;
        if (lane == 0) item = atomicAdd(hd, 1);
        item = __shfl_sync(0xffffffffu, item, 0);
        const int ip = ITEM_PAGES * PAGE / kn.page, hp = ip / 2;      // an item's pages, per half (gate, up)
        const int prow = kn.page / (2 * K);                            // rows per page
        const int claim_at = kn.lead == 0 ? ip / 2 : kn.lead >= ip ? 0 : ip - kn.lead;
        // the kernel's item decode (moe_item: the queue's divisions, the tables' reads; ~0.75 us an item in the H200
        // page stats), modelled as a spin of decode_ns, after the item slot's wait or before it (MK_PG_DECODE_EARLY)
        const auto decode = [&]() {
            if (kn.decode_ns <= 0) return;
            const unsigned long long t0 = gtimer();
            while (gtimer() - t0 < (unsigned long long)kn.decode_ns) {}
        };
        while (true) {                                    // item j into slot j % SLOTS once free, then its pages
            const int q = j % SLOTS;
            if (kn.decode_early) decode();
            if (j >= SLOTS && !kn.selfring) warp_wait(&free_[q], (unsigned)((j / SLOTS) - 1) & 1u, kn.spin);
            if (item >= kn.n_items) break;
            if (!kn.decode_early) decode();
            if (lane == 0) slot_item[q] = item;
            const int ex = item / ITEMS_PER_EXPERT;
            const __nv_bfloat16* e = w + (size_t)(kn.contig ? ex : s_slots[ex]) * (EXPERT_BYTES / 2);
            const int r0 = (item % ITEMS_PER_EXPERT) * ITEM_ROWS;
            // page p (sequence sq): pages 0 .. hp - 1 gate rows r0.., hp .. ip - 1 up rows (EXPERT_ROWS on) r0..
            const auto issue = [&](int p, int sq) {
                const int rs = sq % npg;
                page_q[rs] = q;
                page_p[rs] = p;
                const __nv_bfloat16* src = e + (size_t)((p < hp ? 0 : EXPERT_ROWS) + r0 + (p % hp) * prow) * K;
                if (kn.fence) fence_proxy_async();
                mbar_expect_tx(&full[rs], kn.page);
                bulk_load(ring + (size_t)rs * kn.page, src, kn.page, &full[rs], pol);
            };
            int claim = 0;
            if (kn.multi) {
                // MK_PG_MULTI_ISSUE: lane i page lo + i, each lane polling its own ring page and issuing once free
                const auto poll = [&](int lo, int hi) {
                    const int p = lo + lane, sq = s + p;
                    bool mine = p < hi;
                    const long long t0 = clock64();
                    while (__any_sync(0xffffffffu, mine)) {
                        if (mine && (sq < npg || mbar_test_wait(&empty[sq % npg], (unsigned)((sq / npg) - 1) & 1u))) {
                            issue(p, sq);
                            mine = false;
                        }
                        if (clock64() - t0 > 4000000000ll) __trap();
                    }
                };
                poll(0, claim_at);
                if (lane == 0) claim = atomicAdd(hd, 1);
                poll(claim_at, ip);
            } else if (lane == 0) {                       // the kernel's page loop, the claim between two loops
                const auto page = [&](int p) {
                    const int sq = s + p;
                    if (sq >= npg)
                        lane_wait(kn.selfring ? &full[sq % npg] : &empty[sq % npg], (unsigned)((sq / npg) - 1) & 1u,
                                  kn.spin);
                    issue(p, sq);
                };
                for (int p = 0; p < claim_at; p++) page(p);
                claim = atomicAdd(hd, 1);
                for (int p = claim_at; p < ip; p++) page(p);
            }
            s += ip;
            item = __shfl_sync(0xffffffffu, claim, 0);
            j++;
        }
        if (lane == 0 && kn.selfring)                     // every copy landed before the block leaves
            for (int i = 0; i < npg; i++, s++)
                if (s >= npg) lane_wait(&full[s % npg], (unsigned)((s / npg) - 1) & 1u, kn.spin);
        if (lane == 0 && !kn.selfring)
            for (int i = 0; i < npg; i++, s++) {          // an end marker into every computing warp's page
                const int rs = s % npg;
                if (s >= npg) lane_wait(&empty[rs], (unsigned)((s / npg) - 1) & 1u, kn.spin);
                page_q[rs] = -1;
                mbar_arrive(&full[rs]);
            }
        __syncwarp();
    } else if (warp < npg && !kn.selfring) {
        const __nv_bfloat16* page = reinterpret_cast<const __nv_bfloat16*>(ring + (size_t)warp * kn.page);
        const int ip = ITEM_PAGES * PAGE / kn.page;
        for (int k = 0;; k++) {
            if (kn.cwait) {
                if (lane == 0) lane_wait(&full[warp], (unsigned)k & 1u, kn.spin);
                __syncwarp();
            } else {
                warp_wait(&full[warp], (unsigned)k & 1u, kn.spin);
            }
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
                last = atomicAdd(&done[q], 1) == ip - 1;
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
    const int smem_bytes = MAXPG * PAGE + PAD;      // (a ring of at most 192 KB: npg * page)
    CK(cudaFuncSetAttribute(worker, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    //                      sms npg lead free_early release fence offset math multi decode_ns decode_early n_items page spin
    const Knobs kernel_now = {0, 12, 4, 0, 1, 0, 0, 1, 0, 750, 1, 0, PAGE, 0, 0, 0, 0};   // the default build's worker at b1
    struct Config { const char* name; Knobs k; };
    std::vector<Config> configs;
    auto with = [&](const char* name, auto f) { Knobs k = kernel_now; f(k); configs.push_back({name, k}); };
    with("kernel today (decode 0.75 us before the slot wait)", [](Knobs&) {});
    with("decode after the slot wait (DECODE_EARLY=0)", [](Knobs& k) { k.decode_early = 0; });
    with("no decode (the protocol alone)", [](Knobs& k) { k.decode_ns = 0; });
    with("decode 1.5 us", [](Knobs& k) { k.decode_ns = 1500; });
    with("multi-lane issue (MK_PG_MULTI_ISSUE=1)", [](Knobs& k) { k.multi = 1; });
    with("multi-lane issue, no decode", [](Knobs& k) { k.multi = 1; k.decode_ns = 0; });
    with("a proxy fence per page (MK_PG_PROXY_FENCE=1)", [](Knobs& k) { k.fence = 1; });
    with("free_early (MK_PG_FREE_EARLY=1, removed)", [](Knobs& k) { k.free_early = 1; });
    with("lead 8 (the claim at the item's start)", [](Knobs& k) { k.lead = 8; });
    with("no release", [](Knobs& k) { k.release = 0; });
    with("no math", [](Knobs& k) { k.math = 0; });
    with("8 pages (128 KB in flight at most)", [](Knobs& k) { k.npg = 8; });
    with("loads only (no math, no release, no decode)", [](Knobs& k) { k.math = 0; k.release = 0; k.decode_ns = 0; });
    // what one copy's issue costs: the same loop with 8 KB and 32 KB copies (pages), so 16 and 4 per item (the 32 KB
    // ring: 6 pages, the same 192 KB; the 8 KB ring: 12 pages, 96 KB)
    with("loads only, 8 KB pages (16 per item)", [](Knobs& k) { k.math = 0; k.release = 0; k.decode_ns = 0; k.page = PAGE / 2; });
    with("loads only, 32 KB pages (4 per item)", [](Knobs& k) { k.math = 0; k.release = 0; k.decode_ns = 0; k.page = 2 * PAGE; k.npg = MAXPG / 2; });
    with("32 KB pages, no math (decode, release)", [](Knobs& k) { k.math = 0; k.page = 2 * PAGE; k.npg = MAXPG / 2; });
    with("16 KB pages, no math (decode, release)", [](Knobs& k) { k.math = 0; });
    with("multi-lane, loads only", [](Knobs& k) { k.multi = 1; k.math = 0; k.release = 0; k.decode_ns = 0; });
    // every wait by test_wait instead of try_wait: whether a late wake from try_wait's suspension is the lane-0 loop's
    // fixed cost per copy (it is not: session 40)
    with("kernel today, test_wait", [](Knobs& k) { k.spin = 1; });
    with("loads only, test_wait", [](Knobs& k) { k.math = 0; k.release = 0; k.decode_ns = 0; k.spin = 1; });
    with("loads only, 8 KB pages, test_wait", [](Knobs& k) { k.math = 0; k.release = 0; k.decode_ns = 0; k.page = PAGE / 2; k.spin = 1; });
    with("loads only, 32 KB pages, test_wait", [](Knobs& k) { k.math = 0; k.release = 0; k.decode_ns = 0; k.page = 2 * PAGE; k.npg = MAXPG / 2; k.spin = 1; });
    with("32 KB pages, no math, test_wait", [](Knobs& k) { k.math = 0; k.page = 2 * PAGE; k.npg = MAXPG / 2; k.spin = 1; });
    // the ring without its consumers (tma_issue.cu, session 41: one thread's burst of 12 16 KB copies lands at 85 GB/s
    // per SM at 32 SMs, while this loop, loads only, streams 31): whether the hand-off (a page lands, its warp wakes and
    // frees it, the loader wakes) or the one-at-a-time issue is the lane-0 loop's cost
    with("loads only, self ring (no computing warps)", [](Knobs& k) { k.math = 0; k.release = 0; k.decode_ns = 0; k.selfring = 1; });
    with("loads only, self ring, 32 KB pages", [](Knobs& k) { k.math = 0; k.release = 0; k.decode_ns = 0; k.selfring = 1; k.page = 2 * PAGE; k.npg = MAXPG / 2; });
    with("loads only, lane 0 alone waits for a page", [](Knobs& k) { k.math = 0; k.release = 0; k.decode_ns = 0; k.cwait = 1; });
    with("no math, lane 0 alone waits for a page", [](Knobs& k) { k.cwait = 1; k.math = 0; });
    with("loads only, self ring, contiguous items", [](Knobs& k) { k.math = 0; k.release = 0; k.decode_ns = 0; k.selfring = 1; k.contig = 1; });
    with("loads only, contiguous items", [](Knobs& k) { k.math = 0; k.release = 0; k.decode_ns = 0; k.contig = 1; });
    with("loads only, self ring, test_wait", [](Knobs& k) { k.math = 0; k.release = 0; k.decode_ns = 0; k.selfring = 1; k.spin = 1; });
    with("loads only, self ring, 8 pages", [](Knobs& k) { k.math = 0; k.release = 0; k.decode_ns = 0; k.selfring = 1; k.npg = 8; });
    for (const Config& c : configs)
        if (c.k.npg < 1 || c.k.npg > MAXPG || c.k.offset < 0 || c.k.offset % 16 || c.k.offset + 1024 > PAD
            || c.k.lead < 0 || c.k.decode_ns < 0 || (c.k.page != PAGE && c.k.math)
            || (c.k.selfring && c.k.multi)      // (the multi-lane issue polls `empty`, which no computing warp frees)
            || (c.k.cwait && c.k.math)          // (lanes 1-31 would read a page whose phase they did not observe)
            || (c.k.page != PAGE / 2 && c.k.page != PAGE && c.k.page != 2 * PAGE) || c.k.npg * c.k.page > MAXPG * PAGE) {
            fprintf(stderr, "bad knobs in %s\n", c.name);
            return 1;
        }
    printf("# %s; items of 128 KB from a %zu GB buffer, %d per launch on all SMs and as many per SM on fewer; GB/s "
           "best of 3 launches after a warm-up, configurations interleaved\n", prop.name, BUFFER >> 30, N_ITEMS);
    // (all SMs: HBM-bound on either card; 88, 64 and 32: below HBM on an H100 too, so the per-SM cap shows)
    const int grids[] = {prop.multiProcessorCount, 88, 64, 32};
    for (int grid : grids) {
        const int n_items = (int)((long long)N_ITEMS * grid / prop.multiProcessorCount);   // (a launch's length
        const size_t bytes = (size_t)n_items * ITEM_PAGES * PAGE;                         // the same per SM)
        std::vector<float> best(configs.size(), 1e30f);
        for (int rep = 0; rep < 4; rep++)
            for (size_t c = 0; c < configs.size(); c++) {
                Knobs k = configs[c].k;
                k.sms = grid;
                k.n_items = n_items;
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
