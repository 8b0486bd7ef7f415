// Microbenchmark: what one dependent access on the megakernel's critical path costs while the SMs stream HBM.
// The decode step's small tasks (the fused norm, the router's epilogue, TOPK, a worker's route read, the hand-off
// between them) are chains of L2 round trips and counter hand-offs; in the b1 traces each round trip takes 1.5-4 us,
// ten times an idle L2 hit. This measures, with every other SM streaming its own HBM region through bulk copies
// (TMA, 16 KB chunks, `bg` KB in flight per SM, as the MoE workers and GEMV tiles do), and the probing SM itself
// streaming `local` KB in flight on another warp:
//   chase: one thread's dependent L2-hit loads (ld.global.cg, a random walk over 4 MB of 128-byte lines);
//   hop:   a counter hand-off between two SMs (red.release.gpu.add, then the other spins on ld.acquire.gpu), as
//          task_signal and wait_rec do; per hop, half a round trip;
//   fence / red / signal / acq: one thread's __threadfence(), red.release.gpu, both (task_signal's pair), or a chain
//          of dependent ld.acquire.gpu L2 hits, back to back: which primitive waits for the SM's copies in flight.
// Per configuration it prints the probe's ns per access and the HBM read rate of the streams (GB/s, all SMs),
// so the in-flight depth that saturates HBM and the latency it costs the critical path can be read together.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/mem_latency.cu -o /tmp/mem_latency
//   /tmp/mem_latency [iters] [modes]
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>

constexpr int NT = 128;
constexpr int CHUNK = 16384;                      // bytes per bulk copy
constexpr int MAX_STAGES = 13;                    // 208 KB of ring at most
constexpr size_t CHASE_BYTES = 4u << 20;          // the chase's working set (L2-resident)
constexpr size_t STREAM_BYTES = 4ull << 30;       // the streams' region (far beyond L2)

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ unsigned long long gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void mbar_init(unsigned long long* b) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
    asm volatile("{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}\n"
                 ::"r"(smem_u32(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk(void* dst, const void* src, unsigned long long* b) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(b)), "r"(CHUNK)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(CHUNK), "r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ unsigned ld_cg(const unsigned* p) {
    unsigned v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

extern __shared__ __align__(128) unsigned char smem[];

// Lane 0 of warp 0: stream this block's slice of `src` through a ring of kb / 16 chunks until *stop.
__device__ void stream(const char* src, int kb, const volatile int* stop, unsigned long long* total) {
    const int stages = kb / (CHUNK / 1024);
    if (stages <= 0) return;
    __shared__ __align__(8) unsigned long long bar[MAX_STAGES];
    const size_t slice = (STREAM_BYTES / gridDim.x) / CHUNK * CHUNK;
    const char* base = src + (size_t)blockIdx.x * slice;
    size_t off = 0;
    for (int s = 0; s < stages; s++) mbar_init(&bar[s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int s = 0; s < stages; s++) {
        bulk(smem + (size_t)s * CHUNK, base + off, &bar[s]);
        off = (off + CHUNK) % slice;
    }
    unsigned phase = 0;                               // bit s: the parity stage s completes next
    unsigned long long n = 0;
    int s = 0;
    while (true) {
        mbar_wait(&bar[s], (phase >> s) & 1);
        phase ^= 1u << s;
        n++;
        if ((n & 7) == 0 && *stop) break;
        bulk(smem + (size_t)s * CHUNK, base + off, &bar[s]);
        off = (off + CHUNK) % slice;
        s = s + 1 == stages ? 0 : s + 1;
    }
    for (int i = 1; i < stages; i++) {                // the other stages are still in flight
        s = s + 1 == stages ? 0 : s + 1;
        mbar_wait(&bar[s], (phase >> s) & 1);
        phase ^= 1u << s;
        n++;
    }
    atomicAdd(total, n * CHUNK);
}

// mode 0: block 0's probe walks the chase; mode 1: blocks 0 and 1 hand a counter back and forth.
__global__ void __launch_bounds__(NT, 1) bench(const unsigned* chase, const char* src, int bg_kb, int local_kb,
                                               int mode, int iters, int* stop, int* flags,
                                               unsigned long long* total, unsigned long long* probe_ns) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool prober = blockIdx.x == 0 || (mode == 1 && blockIdx.x == 1);
    if (warp == 0) {
        if (lane == 0) stream(src, prober ? local_kb : bg_kb, stop, total);
        return;
    }
    if (!prober || warp != 1 || lane != 0) return;
    const unsigned long long t_start = gtimer();
    while (gtimer() - t_start < 20000) {}             // the streams fill their rings first
    if (mode == 0) {
        unsigned idx = 0;
        for (int i = 0; i < iters; i++) idx = ld_cg(chase + idx);     // warm pass
        const unsigned long long t0 = gtimer();
        for (int i = 0; i < iters; i++) idx = ld_cg(chase + idx);
        const unsigned long long t1 = gtimer();
        probe_ns[0] = (t1 - t0) + (idx == 0xffffffffu);               // (idx kept live)
        probe_ns[1] = (unsigned long long)iters;
    } else if (mode >= 2) {
        // one SM alone: the cost of each signalling primitive back to back (fence: __threadfence; red: the
        // counter's red.release; signal: both, as task_signal; acquire: a chain of ld.acquire.gpu L2 hits)
        int* mine = flags + 32 * 4;
        unsigned idx = 0;
        const unsigned long long t0 = gtimer();
        for (int i = 0; i < iters; i++) {
            if (mode == 2) __threadfence();
            else if (mode == 3) red_release(mine, 1);
            else if (mode == 4) { __threadfence(); red_release(mine, 1); }
            else idx = (unsigned)ld_acquire(reinterpret_cast<const int*>(chase) + idx);
        }
        const unsigned long long t1 = gtimer();
        probe_ns[0] = (t1 - t0) + (idx == 0xffffffffu);
        probe_ns[1] = (unsigned long long)iters;
    } else {
        int* mine = flags + 32 * blockIdx.x;                          // separate 128-byte lines
        const int* other = flags + 32 * (1 - blockIdx.x);
        const unsigned long long t0 = gtimer();
        for (int i = 1; i <= iters; i++) {
            if (blockIdx.x == 0) {
                red_release(mine, 1);
                while (ld_acquire(other) < i) {}
            } else {
                while (ld_acquire(other) < i) {}
                red_release(mine, 1);
            }
        }
        const unsigned long long t1 = gtimer();
        if (blockIdx.x == 0) { probe_ns[0] = t1 - t0; probe_ns[1] = 2ull * iters; }
    }
    if (blockIdx.x == 0) {
        __threadfence();
        *reinterpret_cast<volatile int*>(stop) = 1;
    }
}

int main(int argc, char** argv) {
    const int iters = argc > 1 ? atoi(argv[1]) : 2000;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    // the chase: a random cycle over the 4 MB's 128-byte lines (word index of the next line's first word)
    const size_t lines = CHASE_BYTES / 128;
    std::vector<unsigned> order(lines), host(CHASE_BYTES / 4, 0);
    for (size_t i = 0; i < lines; i++) order[i] = (unsigned)i;
    srand(1);
    for (size_t i = lines - 1; i > 0; i--) std::swap(order[i], order[(size_t)rand() % (i + 1)]);
    for (size_t i = 0; i < lines; i++) host[(size_t)order[i] * 32] = order[(i + 1) % lines] * 32;
    unsigned* chase;
    char* src;
    int *stop, *flags;
    unsigned long long *total, *probe;
    CK(cudaMalloc(&chase, CHASE_BYTES));
    CK(cudaMemcpy(chase, host.data(), CHASE_BYTES, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&src, STREAM_BYTES));
    CK(cudaMemset(src, 1, STREAM_BYTES));
    CK(cudaMalloc(&stop, 4));
    CK(cudaMalloc(&flags, 4096));
    CK(cudaMalloc(&total, 8));
    CK(cudaMalloc(&probe, 16));
    const int smem_bytes = MAX_STAGES * CHUNK;        // also keeps one block per SM
    CK(cudaFuncSetAttribute(bench, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    printf("# %s, %d SMs, %d accesses per probe; bg / local: KB in flight per streaming SM / on the probing SM\n",
           prop.name, sms, iters);
    printf("%-6s %6s %6s %12s %12s %10s\n", "probe", "bg_kb", "local", "ns/access", "stream_GB/s", "GB/s/SM");
    const int bgs[] = {0, 16, 32, 64, 96, 128, 192};
    const int locals[] = {0, 64, 128};
    const char* names[] = {"chase", "hop", "fence", "red", "signal", "acq"};
    const int modes = argc > 2 ? atoi(argv[2]) : 6;
    for (int mode = 0; mode < modes; mode++)
        for (int local : locals)
            for (int bg : bgs) {
                if (mode >= 2 && bg != 0 && bg != 64 && bg != 128) continue;
                CK(cudaMemset(stop, 0, 4));
                CK(cudaMemset(flags, 0, 4096));
                CK(cudaMemset(total, 0, 8));
                CK(cudaEventRecord(e0));
                bench<<<sms, NT, smem_bytes>>>(chase, src, bg, local, mode, iters, stop, flags, total, probe);
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                CK(cudaGetLastError());
                unsigned long long t = 0, pr[2];
                float ms = 0.f;
                CK(cudaMemcpy(&t, total, 8, cudaMemcpyDeviceToHost));
                CK(cudaMemcpy(pr, probe, 16, cudaMemcpyDeviceToHost));
                CK(cudaEventElapsedTime(&ms, e0, e1));
                const double gbs = t / (ms * 1e-3) / 1e9;
                const int streaming = (bg > 0 ? sms - (mode == 1 ? 2 : 1) : 0) + (local > 0 ? (mode == 1 ? 2 : 1) : 0);
                printf("%-6s %6d %6d %12.1f %12.1f %10.2f\n", names[mode], bg, local,
                       (double)pr[0] / (double)pr[1], gbs, streaming ? gbs / streaming : 0.0);
                fflush(stdout);
            }
    return 0;
}
