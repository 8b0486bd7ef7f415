// mbarrier probe (session 39, not yet run): (1) the raw 64-bit word of an mbarrier after init, arrivals and an
// arrive.expect_tx, to read the words MK_STALL_PRINT reports (under racecheck a stuck paged worker's barriers all read
// 0, which cannot be a state that both passes and fails the waits the drain then passed); (2) a ping-pong of one
// producer warp and one or two consumer warps per phase (the `empty` barrier counting 1 or 2, as MK_PG_PAGE_WARPS=1
// or 2), each waiter spinning on try_wait with a ~12 s timeout: whether the two-consumer form stalls under
// compute-sanitizer --tool racecheck where it does not natively.
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a benchmarks/mbar_probe.cu -o /tmp/p && /tmp/p
//   compute-sanitizer --tool racecheck /tmp/p
#include <cstdio>
__device__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__global__ void k() {
    __shared__ unsigned long long bar[2];
    const int t = threadIdx.x;
    if (t == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(&bar[0])), "r"(2) : "memory");
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(&bar[1])), "r"(1) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        printf("init(2): %016llx  init(1): %016llx\n", *(volatile unsigned long long*)&bar[0], *(volatile unsigned long long*)&bar[1]);
    }
    __syncthreads();
    if (t == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(&bar[0])) : "memory");
    __syncthreads();
    if (t == 0) printf("count2 after 1 arrive: %016llx\n", *(volatile unsigned long long*)&bar[0]);
    __syncthreads();
    if (t == 32) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(&bar[0])) : "memory");
    __syncthreads();
    if (t == 0) printf("count2 after 2 arrives: %016llx\n", *(volatile unsigned long long*)&bar[0]);
    if (t == 0) asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&bar[1])), "r"(1024) : "memory");
    __syncthreads();
    if (t == 0) printf("count1 after arrive.expect_tx(1024): %016llx\n", *(volatile unsigned long long*)&bar[1]);
}
// (appended) ping-pong: producer warp P arrives on full, NC consumer warps wait on full and arrive on empty (count NC)
__device__ bool spin(unsigned long long* b, unsigned par, long long t0) {
    unsigned ok = 0;
    while (!ok) {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(ok) : "r"(sa(b)), "r"(par) : "memory");
        if (!ok && clock64() - t0 > 20000000000LL) return false;
    }
    return true;
}
__global__ void pingpong(int nc, int n, int* fails) {
    __shared__ unsigned long long full, empty;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(&full)), "r"(1) : "memory");
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(&empty)), "r"(nc) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const long long t0 = clock64();
    if (lane == 0 && w == nc) {                 // producer
        for (int k = 0; k < n; k++) {
            if (k > 0 && !spin(&empty, (k - 1) & 1, t0)) { printf("producer stuck at %d\n", k); atomicAdd(fails, 1); break; }
            asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(&full)) : "memory");
        }
    } else if (lane == 0 && w < nc) {           // consumers
        for (int k = 0; k < n; k++) {
            if (!spin(&full, k & 1, t0)) { printf("consumer %d stuck at %d\n", w, k); atomicAdd(fails, 1); break; }
            asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(&empty)) : "memory");
        }
    }
}
int pp_main() {
    int* f; cudaMallocManaged(&f, 4);
    for (int nc = 1; nc <= 2; nc++) {
        *f = 0; pingpong<<<1, 32 * (nc + 1)>>>(nc, 2000, f); cudaError_t e = cudaDeviceSynchronize();
        printf("pingpong %d consumer(s): %s, %d stuck\n", nc, cudaGetErrorString(e), *f);
    }
    return 0;
}
int main() { k<<<1, 64>>>(); cudaError_t e = cudaDeviceSynchronize(); printf("%s\n", cudaGetErrorString(e)); return pp_main(); }
