// Bulk copies (TMA) completing on an mbarrier, and the mbarrier operations around them: what the kernel and its
// copy microbenchmarks (benchmarks/smem_align.cu, sm_stream.cu) share, so that those time the kernel's own copy path.
// Self-contained: no kernel parameters.
#pragma once

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// makes initialised mbarriers visible to the async proxy (the bulk copies' completions)
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// orders this thread's earlier generic-proxy shared-memory accesses before later async-proxy (bulk copy) writes
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// orders the generic-proxy global writes this thread observed (through an acquire) before its later bulk copies' reads
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// L2 policy for data read once per step (weights): evicted first, so activations and KV stay in L2
__device__ __forceinline__ unsigned long long l2_evict_first() {
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
    return pol;
}
// L2 policy for weights prefetched into L2 ahead of their reader (ModelPlan.l2_prefetch): kept over the
// evict-first streams, or with MK_L2PF_EVICT_LAST over everything
__device__ __forceinline__ unsigned long long l2_policy_prefetched(bool evict_last) {
    unsigned long long pol;
    if (evict_last) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(pol));
    else asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(pol));
    return pol;
}
// One thread: prefetch [src, src + bytes) into L2 (both 16-byte multiples; nothing waits on it)
__device__ __forceinline__ void l2_prefetch_bulk(const void* src, unsigned bytes, unsigned long long policy) {
    asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;\n"
                 ::"l"(src), "r"(bytes), "l"(policy) : "memory");
}
// One bulk copy global -> shared of `bytes` (a multiple of 16, both addresses 16-byte aligned), completing on bar.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar,
                                          unsigned long long policy) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy) : "memory");
}
// Before a block's first copy through a tensor map that the host wrote into global memory (MK_ATTN_BULK=2's KV maps): its
// 128 bytes acquired by the tensor-map proxy (the CUDA programming guide's rule for maps copied in by the host).
__device__ __forceinline__ void tensormap_acquire(const void* map) {
    asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;\n" ::"l"(reinterpret_cast<unsigned long long>(map))
                 : "memory");
}

// One 2D tensor copy of box (x = first column, y = first row) of a 2D map (a CUtensorMap, csrc/mk_tmap.h) into dst,
// completing on bar.
__device__ __forceinline__ void bulk_tensor_2d(void* dst, const void* map, int x, int y, unsigned long long* bar,
                                               unsigned long long policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3}], [%4], %5;\n"
        ::"r"(smem_addr(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(smem_addr(bar)),
        "l"(policy) : "memory");
}

// One 3D tensor copy of box (x = first column in a block, y = first row, z = first column block) of a 3D map
// (csrc/mk_tmap.h mk_tmap_encode_swizzled_3d) into dst, completing on bar.
__device__ __forceinline__ void bulk_tensor_3d(void* dst, const void* map, int x, int y, int z,
                                               unsigned long long* bar, unsigned long long policy) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3, %4}], [%5], %6;\n"
        ::"r"(smem_addr(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z),
        "r"(smem_addr(bar)), "l"(policy) : "memory");
}

__device__ __forceinline__ void mbar_inval(unsigned long long* bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// n (>= 1) arrivals at once
__device__ __forceinline__ void mbar_arrive_n(unsigned long long* bar, unsigned n) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(n) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(unsigned long long* bar, unsigned parity) {
    unsigned ok;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return ok != 0;
}
// (non-blocking: a thread of a warp whose lanes poll different barriers issues as soon as its own completes, where
// try_wait may suspend the warp for a lane that is not ready)
__device__ __forceinline__ bool mbar_test_wait(unsigned long long* bar, unsigned parity) {
    unsigned ok;
    asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return ok != 0;
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    while (!mbar_try_wait(bar, parity)) {}
}
