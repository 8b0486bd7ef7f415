// NORM: the residual add (attention, MoE and dense/shared MLP outputs) and the norm of one row; the same two steps
// serve the GEMV tasks that normalise their own input rows (the `fused_norm` plan knob, mk_gemv.cuh).
#pragma once
#include "mk_common.cuh"

// (MK_NORM_TABLES_EARLY, removed in session 26: the fused norm's tables read by thread 0 before the dependency wait
// measured 7-8% slower at b1, b8 and b16 (79f285f), not understood; MK_EARLY_TABLES's loads before the wait paid.)

#if MK_SMALL_VEC
// Both work on 8 consecutive columns per thread (16-byte loads and stores): thread t owns the columns 8c..8c+7 for
// c = t, t + NT, ... (H is a multiple of 8), and norm_row reads exactly the columns residual_row wrote, so the two
// need no barrier between them. All of a thread's L2 loads for a group of columns are issued before any is used:
// one round trip per group instead of one per column and source (the scalar loop took ~10 us per row).
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return (unsigned)__bfloat16_as_ushort(f2bf(lo)) | ((unsigned)__bfloat16_as_ushort(f2bf(hi)) << 16);
}
__device__ __forceinline__ uint4 pack8(const float* f) {
    return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}

// Where the residual of `row` entering layer l >= 1 comes from (layer l - 1's h, attention and MLP outputs, its
// routed experts' outputs y), in 16-byte groups of 8 columns.
struct ResidualSrc {
    const uint4 *hp, *ao, *y, *mo;
    int kind, comb, ny;                      // the MLP kind, the shared experts' combination, the routed outputs
};
// The tables the residual and norm of layer l >= 1 read: layer l - 1's MoE index and MLP kind, and layer l's norm
// weights (the final norm's for l == L). Fixed for the launch, so a fused tile may read them before its dependency
// wait (MK_FUSED_TABLES_EARLY). Read alone after the wait they took 1.4-2.2 us (session 33's serial traces, b1), but
// read before it the rows' loads still arrived ~3.5 us after the wait: they were not what held them.
struct NormTables {
    int m, kind;
    const uint4* w;
};
__device__ __forceinline__ NormTables norm_tables(const Params& P, int l) {
    const int* li = layer_info(P, l - 1);
    NormTables t;
    t.m = li[LI_MOE_IDX];
    t.kind = li[LI_MLP_KIND];
    t.w = reinterpret_cast<const uint4*>(
        (l == PI(L)) ? PP(const bf16*, final_norm) : reinterpret_cast<const bf16*>(layer_wptr(P, l)[WP_NORM]));
    return t;
}
__device__ __forceinline__ ResidualSrc residual_src(const Params& P, int l, int row, int m, int kind) {
    const int H = PI(H), Bm = PI(Bm), topk = PI(topk), lp = l - 1;
    ResidualSrc r;
    r.hp = reinterpret_cast<const uint4*>(PP(const bf16*, h) + ((size_t)lp * Bm + row) * H);
    r.ao = reinterpret_cast<const uint4*>(PP(const bf16*, ao) + ((size_t)lp * Bm + row) * H);
    r.y = reinterpret_cast<const uint4*>(PP(const bf16*, y) + ((size_t)(m < 0 ? 0 : m) * Bm + row) * topk * H);
    r.mo = reinterpret_cast<const uint4*>(PP(const bf16*, mout) + ((size_t)lp * Bm + row) * H);
    r.kind = kind;
    r.comb = PI(shared_comb);
    r.ny = m >= 0 ? topk : 0;
    return r;
}

// acc (8 columns) plus the next routed expert's output yv, in rank order (the first one starts the sum).
__device__ __forceinline__ void add_expert8(float* acc, uint4 yv, bool first) {
    float f[8];
    unpack8(yv, f);
#pragma unroll
    for (int j = 0; j < 8; j++) acc[j] = first ? f[j] : rbf(acc[j] + f[j]);
}

// The residual of 8 columns from h, the attention output, the MLP output and the routed experts' sum acc, rounded
// as the PyTorch path rounds them (the shared / dense MLP, then h + attention + that).
__device__ __forceinline__ void residual8(uint4 hv, uint4 av, uint4 mv, const float* acc, int kind, int comb,
                                          float* out) {
    float hf[8], af[8], mf[8];
    unpack8(hv, hf);
    unpack8(av, af);
    unpack8(mv, mf);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        float a = acc[j];
        if (kind == MK_MLP_DENSE) a = mf[j];
        else if (kind == MK_MLP_SHARED) a = comb == MK_COMB_SUM ? rbf(a + mf[j]) : rbf(rbf(a + mf[j]) * 0.5f);
        out[j] = rbf(rbf(hf[j] + af[j]) + a);
    }
}

// x of 8 columns v (fp32 residual) with norm weights wv: RMSNorm (scale r) or LayerNorm (mean, scale r).
__device__ __forceinline__ uint4 norm8(uint4 wv, const float* v, bool rms, float mean, float r) {
    float wf[8], xf[8];
    unpack8(wv, wf);
#pragma unroll
    for (int j = 0; j < 8; j++)
        xf[j] = rms ? bf2f(f2bf(wf[j] * rbf(v[j] * r))) : bf2f(f2bf(wf[j] * ((v[j] - mean) * r)));
    return pack8(xf);
}

// The residual stream of `row` entering layer l into sH (fp32): the embedding for l == 0, else h_{l-1} + the
// attention output + the MLP output of layer l-1, rounded as the PyTorch path rounds them (per column: the routed
// experts' outputs added in rank order, then the shared / dense MLP, then h + attention + that). All threads.
__device__ __forceinline__ void residual_row(const Params& P, int l, int row, float* sH) {
    const int H = PI(H), C = H >> 3;
    if (l == 0) {
        const int tok = step_in(P)[row];
        const uint4* e = reinterpret_cast<const uint4*>(PP(const bf16*, embed) + (size_t)tok * H);
        for (int c = threadIdx.x; c < C; c += NT) unpack8(__ldg(e + c), sH + 8 * c);
        return;
    }
    const int* li = layer_info(P, l - 1);
    const ResidualSrc src = residual_src(P, l, row, li[LI_MOE_IDX], li[LI_MLP_KIND]);
    for (int c = threadIdx.x; c < C; c += NT) {
        const uint4 hv = __ldcg(src.hp + c), av = __ldcg(src.ao + c);
        const uint4 mv = src.kind != MK_MLP_NONE ? __ldcg(src.mo + c) : make_uint4(0, 0, 0, 0);
        float acc[8];
#pragma unroll
        for (int j = 0; j < 8; j++) acc[j] = 0.f;
        for (int k0 = 0; k0 < src.ny; k0 += 4) {        // the experts' outputs, 4 loads in flight
            uint4 yv[4];
#pragma unroll
            for (int k = 0; k < 4; k++)
                yv[k] = k0 + k < src.ny ? __ldcg(src.y + (size_t)(k0 + k) * C + c) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (k0 + k < src.ny) add_expert8(acc, yv[k], k0 + k == 0);
        }
        residual8(hv, av, mv, acc, src.kind, src.comb, sH + 8 * c);
    }
}

// The norm of layer l (l == L: the final norm) of the row in sH: x (bf16, shared or global memory, 16-byte aligned)
// and, when hout is given, the row itself (bf16). All threads; red holds NW floats.
__device__ __forceinline__ void norm_row(const Params& P, int l, const float* sH, float* red, bf16* x, bf16* hout) {
    const int H = PI(H), L = PI(L), C = H >> 3;
    const uint4* w = reinterpret_cast<const uint4*>(
        (l == L) ? PP(const bf16*, final_norm) : reinterpret_cast<const bf16*>(layer_wptr(P, l)[WP_NORM]));
    const float eps = PF(norm_eps);
    const bool rms = PI(norm_type) == MK_NORM_RMS;
    float part = 0.f;
    for (int c = threadIdx.x; c < C; c += NT)
#pragma unroll
        for (int j = 0; j < 8; j++) part += rms ? sH[8 * c + j] * sH[8 * c + j] : sH[8 * c + j];
    float mean = 0.f, r;
    if (rms) {
        r = rsqrtf(block_sum(part, red) / (float)H + eps);
    } else {
        mean = block_sum(part, red) / (float)H;
        float pv = 0.f;
        for (int c = threadIdx.x; c < C; c += NT)
#pragma unroll
            for (int j = 0; j < 8; j++) pv += (sH[8 * c + j] - mean) * (sH[8 * c + j] - mean);
        r = rsqrtf(block_sum(pv, red) / (float)H + eps);
    }
    for (int c = threadIdx.x; c < C; c += NT) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = sH[8 * c + j];
        reinterpret_cast<uint4*>(x)[c] = norm8(__ldg(w + c), v, rms, mean, r);
        if (hout) reinterpret_cast<uint4*>(hout)[c] = pack8(v);
    }
}

// the columns a thread owns: 8c..8c+7 for c = t, t + NT, ...
#define NORM_COLS_PER_THREAD 8

#if MK_SMALL_VEC >= 2
// MK_FUSED_SERIAL=1 (profiling builds only; a measurement, not a kernel): a router or QKV tile's fused norm first
// reads its sources one after another, thread 0 stamping marks 1-3 (opcodes.PROF_MARKS) as the layer tables, the
// `h` row and the norm weights arrive, then reads them all again as the normal build does. Each mark minus the one
// before is one source's own round trip under the layer head's traffic, which the normal build's single "inputs
// ready" (5-6 us after the wait at b1) cannot split. MK_FUSED_SERIAL=2: the normal build's loads, and mark 1 once
// all of them have arrived (thread 0's), so "inputs ready" minus it is the sums and the block's barriers.
// MK_FUSED_SERIAL=3: as 1 for the sources written moments before the wait: the attention output ao, the MLP output
// mo and the 8 expert rows y (session 33 left them as the slow part: h and the weights take 0.4-0.8 us each).
// MK_FUSED_SERIAL=4 (mk_gemv.cuh task_gemv): the whole fused norm twice (the register path, FUSED_NORM_IN_REGS;
// the other one doubles only the GEMV), then the GEMV twice (both idempotent:
// the same values written again), so a second, warm pass (code in the instruction cache, sources read once) says
// how much of the first pass's time is cold code and fresh lines rather than the loads' own round trips.
#ifndef MK_FUSED_SERIAL
#define MK_FUSED_SERIAL 0
#endif
#if MK_PROFILE && MK_FUSED_SERIAL
// Thread 0 stamps mark k once v has arrived: the timer read is predicated on a test of v's bits (both ways), so
// neither the compiler nor ptxas can take it before the load's value is in registers, which an empty asm with v as
// input does not ensure (it emits no instruction to wait on). The memory clobber keeps the next source's load after.
__device__ __forceinline__ void mark_when_loaded(int k, uint4 v) {
    long long t;
    asm volatile("{\n .reg .pred p;\n setp.ne.u32 p, %1, 0x7fc00001;\n @p mov.u64 %0, %%globaltimer;\n"
                 " @!p mov.u64 %0, %%globaltimer;\n}" : "=l"(t) : "r"(v.x ^ v.y ^ v.z ^ v.w) : "memory");
    if (threadIdx.x == 0) s_pmark[k] = t;
}
#endif

// NORM of layer l >= 1 with every load of a thread in flight at once (MK_SMALL_VEC=2, rows of H <= 8 * NT): thread
// t owns columns 8t..8t+7 as above and issues its h, attention, MLP, norm-weight and first 8 experts' loads
// together (one L2 round trip where residual_row and norm_row take three or four), keeps the residual in registers,
// and normalises it there. The same sums in the same order as residual_row + norm_row (bit-identical results).
template <bool kSourceMarks = false>    // true: a fused tile's norm (MK_FUSED_SERIAL's marks), false: NORM's
// t: the layer's tables (norm_tables).
__device__ __forceinline__ void residual_norm_fused(const Params& P, int l, int row, const NormTables& t, float* red,
                                                    bf16* x, bf16* hout) {
    const int H = PI(H), C = H >> 3;
    const ResidualSrc src = residual_src(P, l, row, t.m, t.kind);
    const uint4* w = t.w;
    const int ny = src.ny;
    const float eps = PF(norm_eps);
    const bool rms = PI(norm_type) == MK_NORM_RMS;
    const int c = threadIdx.x;
    const bool on = c < C;
    const uint4 z = make_uint4(0, 0, 0, 0);
    uint4 hv = z, av = z, mv = z, wv = z, yv[8];
#pragma unroll
    for (int k = 0; k < 8; k++) yv[k] = z;
#if MK_PROFILE && MK_FUSED_SERIAL == 1
    if (kSourceMarks && on) {
        mark_when_loaded(1, make_uint4((unsigned)(size_t)src.y, (unsigned)(size_t)w, (unsigned)src.kind, 0u));
        mark_when_loaded(2, __ldcg(src.hp + c));
        mark_when_loaded(3, __ldg(w + c));
    }
#elif MK_PROFILE && MK_FUSED_SERIAL == 3
    if (kSourceMarks && on) {        // the recently written sources, one after another: ao, mo, the 8 expert rows
        mark_when_loaded(1, __ldcg(src.ao + c));
        mark_when_loaded(2, src.kind != MK_MLP_NONE ? __ldcg(src.mo + c) : make_uint4(1u, 0u, 0u, 0u));
        uint4 all = make_uint4(0u, 0u, 0u, 0u);
        uint4 yk[8];
#pragma unroll
        for (int k = 0; k < 8; k++) yk[k] = k < ny ? __ldcg(src.y + (size_t)k * C + c) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int k = 0; k < 8; k++) { all.x ^= yk[k].x; all.y ^= yk[k].y; all.z ^= yk[k].z; all.w ^= yk[k].w; }
        mark_when_loaded(3, all);
    }
#endif
    if (on) {
        hv = __ldcg(src.hp + c);
        av = __ldcg(src.ao + c);
        if (src.kind != MK_MLP_NONE) mv = __ldcg(src.mo + c);
        wv = __ldg(w + c);
#pragma unroll
        for (int k = 0; k < 8; k++)
            if (k < ny) yv[k] = __ldcg(src.y + (size_t)k * C + c);
    }
#if MK_PROFILE && MK_FUSED_SERIAL == 2
    if (kSourceMarks && on) {       // mark 1 once every source above has arrived (before the sums)
        uint4 all = make_uint4(hv.x ^ av.x ^ mv.x ^ wv.x, hv.y ^ av.y ^ mv.y ^ wv.y, hv.z ^ av.z ^ mv.z ^ wv.z,
                               hv.w ^ av.w ^ mv.w ^ wv.w);
#pragma unroll
        for (int k = 0; k < 8; k++) { all.x ^= yv[k].x; all.y ^= yv[k].y; all.z ^= yv[k].z; all.w ^= yv[k].w; }
        mark_when_loaded(1, all);
    }
#endif
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = 0.f;
    if (on) {
        float acc[8];
#pragma unroll
        for (int j = 0; j < 8; j++) acc[j] = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++)
            if (k < ny) add_expert8(acc, yv[k], k == 0);
        for (int k = 8; k < ny; k++)              // more than 8 experts per token: the rest one at a time
            add_expert8(acc, __ldcg(src.y + (size_t)k * C + c), false);
        residual8(hv, av, mv, acc, src.kind, src.comb, v);
    }
    prof_phase(0);
    float part = 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) part += rms ? v[j] * v[j] : v[j];
    float mean = 0.f, r;
    if (rms) {
        r = rsqrtf(block_sum(part, red) / (float)H + eps);
    } else {
        mean = block_sum(part, red) / (float)H;
        float pv = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) pv += on ? (v[j] - mean) * (v[j] - mean) : 0.f;
        r = rsqrtf(block_sum(pv, red) / (float)H + eps);
    }
    if (on) {
        reinterpret_cast<uint4*>(x)[c] = norm8(wv, v, rms, mean, r);
        if (hout) reinterpret_cast<uint4*>(hout)[c] = pack8(v);
    }
}
#endif
#else
// The residual stream of `row` entering layer l into sH (fp32): the embedding for l == 0, else h_{l-1} + the
// attention output + the MLP output of layer l-1, rounded as the PyTorch path rounds them. All threads; thread t
// writes the columns t, t + NT, ... (norm_row reads the same ones).
__device__ __forceinline__ void residual_row(const Params& P, int l, int row, float* sH) {
    const int H = PI(H), Bm = PI(Bm), topk = PI(topk);
    if (l == 0) {
        const int tok = step_in(P)[row];
        const bf16* e = PP(const bf16*, embed) + (size_t)tok * H;
        for (int i = threadIdx.x; i < H; i += NT) sH[i] = bf2f(e[i]);
        return;
    }
    const int lp = l - 1;
    const int* li = layer_info(P, lp);
    const int m = li[LI_MOE_IDX], kind = li[LI_MLP_KIND];
    const bf16* hp = PP(const bf16*, h) + ((size_t)lp * Bm + row) * H;
    const bf16* ao = PP(const bf16*, ao) + ((size_t)lp * Bm + row) * H;
    const bf16* y = PP(const bf16*, y) + ((size_t)(m < 0 ? 0 : m) * Bm + row) * topk * H;
    const bf16* mo = PP(const bf16*, mout) + ((size_t)lp * Bm + row) * H;
    const int comb = PI(shared_comb);
#pragma unroll 4
    for (int i = threadIdx.x; i < H; i += NT) {       // unrolled: the L2 round trips of 4 columns overlap
        float acc = 0.f;
        if (m >= 0) {
            acc = ldcg_bf(y + i);
            for (int k = 1; k < topk; k++) acc = rbf(acc + ldcg_bf(y + (size_t)k * H + i));
        }
        if (kind == MK_MLP_DENSE) {
            acc = ldcg_bf(mo + i);
        } else if (kind == MK_MLP_SHARED) {
            const float sh = ldcg_bf(mo + i);
            acc = comb == MK_COMB_SUM ? rbf(acc + sh) : rbf(rbf(acc + sh) * 0.5f);
        }
        sH[i] = rbf(rbf(ldcg_bf(hp + i) + ldcg_bf(ao + i)) + acc);
    }
}

// The norm of layer l (l == L: the final norm) of the row in sH: x (bf16, shared or global memory) and, when hout is
// given, the row itself (bf16). All threads; red holds NW floats.
__device__ __forceinline__ void norm_row(const Params& P, int l, const float* sH, float* red, bf16* x, bf16* hout) {
    const int H = PI(H), L = PI(L);
    const bf16* w = (l == L) ? PP(const bf16*, final_norm) : reinterpret_cast<const bf16*>(layer_wptr(P, l)[WP_NORM]);
    const float eps = PF(norm_eps);
    float part = 0.f;
    if (PI(norm_type) == MK_NORM_RMS) {
        for (int i = threadIdx.x; i < H; i += NT) part += sH[i] * sH[i];
        const float r = rsqrtf(block_sum(part, red) / (float)H + eps);
        for (int i = threadIdx.x; i < H; i += NT) {
            if (hout) hout[i] = f2bf(sH[i]);
            x[i] = f2bf(bf2f(w[i]) * rbf(sH[i] * r));
        }
    } else {
        for (int i = threadIdx.x; i < H; i += NT) part += sH[i];
        const float mean = block_sum(part, red) / (float)H;
        float pv = 0.f;
        for (int i = threadIdx.x; i < H; i += NT) pv += (sH[i] - mean) * (sH[i] - mean);
        const float r = rsqrtf(block_sum(pv, red) / (float)H + eps);
        for (int i = threadIdx.x; i < H; i += NT) {
            if (hout) hout[i] = f2bf(sH[i]);
            x[i] = f2bf(bf2f(w[i]) * ((sH[i] - mean) * r));
        }
    }
}

// the columns a thread owns: t, t + NT, ...
#define NORM_COLS_PER_THREAD 1
#endif

// ---- NORM: residual add (+ MoE combine) and norm of one row ----------------------------------------------------
// Not inlined into the persistent loop: inlined, its vectorised loads' registers spill there.
__device__ __noinline__ bool task_norm(const Params& P, const int* rec, int ticket) {
    if (!wait_rec(P, rec, ticket)) return false;
    const int l = rec[RF_LAYER], row = rec[RF_A0];
    const int H = PI(H), Bm = PI(Bm);
    if (!smem_fits(P, (size_t)(H + NW) * 4, ticket)) return false;
    float* sH = reinterpret_cast<float*>(smem);
    for (int rep = 0; rep < MK_REPEAT_SMALL; rep++) {   // (reads layer l - 1's buffers, writes layer l's)
        if (rep) __syncthreads();
#if MK_SMALL_VEC >= 2
        if (l > 0 && (H >> 3) <= NT) {
            residual_norm_fused(P, l, row, norm_tables(P, l), sH + H, PP(bf16*, x) + ((size_t)l * Bm + row) * H,
                                PP(bf16*, h) + ((size_t)l * Bm + row) * H);
            prof_phase(1);
            continue;
        }
#endif
        residual_row(P, l, row, sH);
        prof_phase(0);
        norm_row(P, l, sH, sH + H, PP(bf16*, x) + ((size_t)l * Bm + row) * H, PP(bf16*, h) + ((size_t)l * Bm + row) * H);
        prof_phase(1);
    }
    task_signal(P, rec[RF_SIG]);
    return true;
}
