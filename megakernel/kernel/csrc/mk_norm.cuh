// NORM: the residual add (attention, MoE and dense/shared MLP outputs) and the norm of one row; the same two steps
// serve the GEMV tasks that normalise their own input rows (the `fused_norm` plan knob, mk_gemv.cuh).
#pragma once
#include "mk_common.cuh"

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

// ---- NORM: residual add (+ MoE combine) and norm of one row ----------------------------------------------------
__device__ bool task_norm(const Params& P, const int* rec, int ticket) {
    if (!wait_rec(P, rec, ticket)) return false;
    const int l = rec[RF_LAYER], row = rec[RF_A0];
    const int H = PI(H), Bm = PI(Bm);
    if (!smem_fits(P, (size_t)(H + NW) * 4, ticket)) return false;
    float* sH = reinterpret_cast<float*>(smem);
    residual_row(P, l, row, sH);
    norm_row(P, l, sH, sH + H, PP(bf16*, x) + ((size_t)l * Bm + row) * H, PP(bf16*, h) + ((size_t)l * Bm + row) * H);
    block_signal(P, rec[RF_SIG]);
    return true;
}
