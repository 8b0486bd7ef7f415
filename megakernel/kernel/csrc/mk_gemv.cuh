// GEMV: the weight-tile core every projection runs on, the static projection tasks (QKV with RoPE and the
// K/V append, O, router, dense/shared MLP, LM head) and the greedy ARGMAX over the LM head's tiles.
#pragma once
#include "mk_common.cuh"
#include "mk_norm.cuh"      // residual_row / norm_row: tiles with FLAG_FUSED_NORM normalise their own inputs

// ---- GEMV: a tile of weight rows (staged in shared memory) times up to MB input rows ---------------------------
// Layout: sRed [64*MB] f32 | sOut [64*MB] f32 | sW [R][K] bf16 | sX [nb][K] bf16, R the tile's rows (all halves):
// the inputs start right after the tile's weights (schedule.gemv_smem_bytes sizes it; tile_rows keeps it in bounds).
#define SM_RED 0
#define SM_OUT (64 * MB * 4)
#define SM_W MK_GEMV_SCRATCH_BYTES
__device__ __forceinline__ size_t sm_x(int R, int K) { return SM_W + (size_t)R * K * 2; }

struct Tile {
    const bf16* w0;
    int n0;
    const bf16* w1;
    int n1;
    int K;
};

// Starts the async copy of the tile's weights (immutable: safe before any wait).
__device__ __forceinline__ void issue_weights(const Tile& T) {
    bf16* sW = reinterpret_cast<bf16*>(smem + SM_W);
    const int per_row = T.K >> 3;
    const int u0 = T.n0 * per_row, u1 = T.n1 * per_row;
    for (int u = threadIdx.x; u < u0 + u1; u += NT) {
        const bf16* src = (u < u0) ? T.w0 + (size_t)u * 8 : T.w1 + (size_t)(u - u0) * 8;
        cp_async16(sW + (size_t)u * 8, src);
    }
    cp_async_commit();
    prof_mark(PS_ISSUED);
}

__shared__ const bf16* s_xrow[MB];

// Copies nb input rows (pointers in s_xrow) of K elements into sX (after the R weight rows), then waits for every
// pending copy.
__device__ __forceinline__ void load_x_and_wait(int nb, int K, int R) {
    bf16* sX = reinterpret_cast<bf16*>(smem + sm_x(R, K));
    const int per_row = K >> 3;
    for (int u = threadIdx.x; u < nb * per_row; u += NT) {
        const int b = u / per_row, c = u - b * per_row;
        cp_async16(sX + (size_t)b * K + c * 8, s_xrow[b] + c * 8);
    }
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    prof_mark(PS_LANDED);
}

// sOut[r * MB + b] = dot(W[r, :], X[b, :]) in fp32 for r < R, b < nb. Each warp takes (row, K-slice) items.
template <int BM>
__device__ __forceinline__ void gemv_core(int R, int K, int nb) {
    const bf16* sW = reinterpret_cast<const bf16*>(smem + SM_W);
    const bf16* sX = reinterpret_cast<const bf16*>(smem + sm_x(R, K));
    float* sRed = reinterpret_cast<float*>(smem + SM_RED);
    float* sOut = reinterpret_cast<float*>(smem + SM_OUT);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int KC = K >> 3;
    const int KS = (R >= NW) ? 1 : (NW / R);
    const int items = R * KS;
    for (int it = warp; it < items; it += NW) {
        const int r = it / KS, ks = it - r * KS;
        const int c0 = (ks * KC) / KS, c1 = ((ks + 1) * KC) / KS;
        float acc[BM];
#pragma unroll
        for (int b = 0; b < BM; b++) acc[b] = 0.f;
        const uint4* wrow = reinterpret_cast<const uint4*>(sW + (size_t)r * K);
        for (int c = c0 + lane; c < c1; c += 32) {
            float wf[8];
            unpack8(wrow[c], wf);
#pragma unroll
            for (int b = 0; b < BM; b++) {
                if (b < nb) {
                    float xf[8];
                    unpack8(reinterpret_cast<const uint4*>(sX + (size_t)b * K)[c], xf);
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[b] = fmaf(wf[e], xf[e], acc[b]);
                }
            }
        }
#pragma unroll
        for (int b = 0; b < BM; b++) {
            const float v = warp_sum(acc[b]);
            if (lane == 0 && b < nb) sRed[it * MB + b] = v;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < R * nb; i += NT) {
        const int r = i / nb, b = i - r * nb;
        float s = 0.f;
        for (int ks = 0; ks < KS; ks++) s += sRed[(r * KS + ks) * MB + b];
        sOut[r * MB + b] = s;
    }
    __syncthreads();
}

__device__ __noinline__ void gemv(int R, int K, int nb) {
    if (nb <= 1) gemv_core<1>(R, K, nb);
    else if (nb <= 2) gemv_core<2>(R, K, nb);
    else if (nb <= 4) gemv_core<4>(R, K, nb);
    else if (nb <= 8) gemv_core<8>(R, K, nb);
    else gemv_core<16>(R, K, nb);
    prof_mark(PS_COMPUTED);                 // after gemv_core's closing barrier: every partial sum is in sOut
}

// ---- static GEMV tasks ---------------------------------------------------------------------------------------
// Weights first (prefetch), then the waits, then the inputs, then the math and the task's epilogue.
__device__ bool task_gemv(const Params& P, const int* rec, int ticket) {
    const int op = rec[RF_OP], l = rec[RF_LAYER], r0 = rec[RF_A0], nr = rec[RF_A1];
    const int H = PI(H), Bm = PI(Bm), B = PI(B), L = PI(L);
    const int Q = PI(n_heads) * PI(head_dim);
    const long long* wp = l < L ? layer_wptr(P, l) : nullptr;
    const int* li = l < L ? layer_info(P, l) : nullptr;
    Tile T;
    T.w1 = nullptr;
    T.n1 = 0;
    T.n0 = nr;
    const bf16* xin;
    int xpitch;
    switch (op) {
        case OP_QKV:
            T.K = H; T.w0 = reinterpret_cast<const bf16*>(wp[WP_QKV]) + (size_t)r0 * H;
            xin = PP(const bf16*, x) + (size_t)l * Bm * H; xpitch = H;
            break;
        case OP_OPROJ:
            T.K = Q; T.w0 = reinterpret_cast<const bf16*>(wp[WP_O]) + (size_t)r0 * Q;
            xin = PP(const bf16*, attn) + (size_t)l * Bm * Q; xpitch = Q;
            break;
        case OP_ROUTER:
            T.K = H; T.w0 = reinterpret_cast<const bf16*>(wp[WP_ROUTER]) + (size_t)r0 * H;
            xin = PP(const bf16*, x) + (size_t)l * Bm * H; xpitch = H;
            break;
        case OP_MLP_GU: {
            const int width = li[LI_MLP_WIDTH];
            const bf16* w = reinterpret_cast<const bf16*>(wp[WP_MLP_GU]);
            T.K = H; T.w0 = w + (size_t)r0 * H; T.w1 = w + (size_t)(width + r0) * H; T.n1 = nr;
            xin = PP(const bf16*, x) + (size_t)l * Bm * H; xpitch = H;
            break;
        }
        case OP_MLP_DOWN: {
            const int width = li[LI_MLP_WIDTH];
            T.K = width; T.w0 = reinterpret_cast<const bf16*>(wp[WP_MLP_DOWN]) + (size_t)r0 * width;
            xin = PP(const bf16*, mact) + (size_t)l * Bm * PI(I_mlp); xpitch = PI(I_mlp);
            break;
        }
        default:  // OP_LM_HEAD
            T.K = H; T.w0 = PP(const bf16*, lm_head) + (size_t)r0 * H;
            xin = PP(const bf16*, x) + (size_t)L * Bm * H; xpitch = H;
            break;
    }
    const int flags = rec[RF_FLAGS];
    const bool fused = (flags & MK_FLAG_FUSED_NORM) != 0;      // QKV / ROUTER / MLP_GU only: K == H
    const int R = T.n0 + T.n1;
    const size_t x_end = sm_x(R, T.K) + (size_t)B * T.K * 2;
    if (!smem_fits(P, x_end + (fused ? (size_t)(H + NW) * 4 : 0), ticket)) return false;
    issue_weights(T);
    if (!fused && threadIdx.x < B) s_xrow[threadIdx.x] = xin + (size_t)threadIdx.x * xpitch;
    if (!wait_rec(P, rec, ticket)) { cp_async_wait_all(); return false; }
    if (fused) {       // the rows' residual and norm straight into sX (the weights keep landing meanwhile)
        bf16* sX = reinterpret_cast<bf16*>(smem + sm_x(R, T.K));
        float* sH = reinterpret_cast<float*>(smem + x_end);
        for (int b = 0; b < B; b++) {
            residual_row(P, l, b, sH);
            bf16* hdst = (flags & MK_FLAG_WRITE_H) ? PP(bf16*, h) + ((size_t)l * Bm + b) * H : nullptr;
            norm_row(P, l, sH, sH + H, sX + (size_t)b * T.K, hdst);
            if (flags & MK_FLAG_WRITE_X) {      // same columns per thread as norm_row wrote: no barrier needed
                bf16* xg = PP(bf16*, x) + ((size_t)l * Bm + b) * H;
                for (int i = threadIdx.x; i < H; i += NT) xg[i] = sX[(size_t)b * T.K + i];
            }
            __syncthreads();                    // sH is the next row's
        }
        cp_async_wait_all();
        __syncthreads();
        prof_mark(PS_LANDED);
    } else {
        load_x_and_wait(B, T.K, R);
    }
    gemv(R, T.K, B);
    const float* sOut = reinterpret_cast<const float*>(smem + SM_OUT);
    switch (op) {
        case OP_QKV: {
            const int d = PI(head_dim), KVs = PI(n_kv) * d;
            const bf16* bias = reinterpret_cast<const bf16*>(wp[WP_QKV_BIAS]);
            const int region = r0 < Q ? 0 : (r0 < Q + KVs ? 1 : 2);
            const int rel = r0 - (region == 0 ? 0 : (region == 1 ? Q : Q + KVs));
            const int head = rel / d, dd0 = rel % d;
            const bool rope = li[LI_USES_ROPE] && region < 2;
            const float* inv_freq = PP(const float*, inv_freq);
            const int* pos = step_in(P) + Bm;
            for (int i = threadIdx.x; i < (nr / 2) * B; i += NT) {
                const int pr = i / B, b = i - pr * B, r = 2 * pr;
                float v0 = sOut[r * MB + b], v1 = sOut[(r + 1) * MB + b];
                if (bias) { v0 += bf2f(bias[r0 + r]); v1 += bf2f(bias[r0 + r + 1]); }
                v0 = rbf(v0); v1 = rbf(v1);
                if (rope) {
                    const float ang = (float)pos[b] * inv_freq[(dd0 + r) >> 1];
                    const float c = rbf(cosf(ang)), s = rbf(sinf(ang));
                    const float o0 = v0 * c + (-v1) * s;
                    const float o1 = v1 * c + v0 * s;
                    v0 = o0; v1 = o1;
                }
                bf16* dst;
                if (region == 0) {
                    dst = PP(bf16*, q) + ((size_t)l * Bm + b) * Q + r0 + r;
                } else {
                    dst = kv_slot(P, li[LI_GROUP], li[LI_LIG], b, pos[b]) + (region == 2 ? (size_t)PI(block_size) * KVs : 0)
                          + head * d + dd0 + r;
                }
                dst[0] = f2bf(v0);
                dst[1] = f2bf(v1);
            }
            break;
        }
        case OP_OPROJ: {
            const bf16* bias = reinterpret_cast<const bf16*>(wp[WP_O_BIAS]);
            bf16* out = PP(bf16*, ao) + (size_t)l * Bm * H;
            for (int i = threadIdx.x; i < nr * B; i += NT) {
                const int r = i / B, b = i - r * B;
                float v = sOut[r * MB + b];
                if (bias) v += bf2f(bias[r0 + r]);
                out[(size_t)b * H + r0 + r] = f2bf(v);
            }
            break;
        }
        case OP_ROUTER: {
            const int E = PI(E);
            float* out = PP(float*, rlog) + (size_t)li[LI_MOE_IDX] * Bm * E;
            for (int i = threadIdx.x; i < nr * B; i += NT) {
                const int r = i / B, b = i - r * B;
                out[(size_t)b * E + r0 + r] = rbf(sOut[r * MB + b]);
            }
            break;
        }
        case OP_MLP_GU: {
            const int pitch = PI(I_mlp);
            bf16* out = PP(bf16*, mact) + (size_t)l * Bm * pitch;
            for (int i = threadIdx.x; i < nr * B; i += NT) {
                const int r = i / B, b = i - r * B;
                const float g = rbf(sOut[r * MB + b]), u = rbf(sOut[(nr + r) * MB + b]);
                out[(size_t)b * pitch + r0 + r] = f2bf(rbf(g / (1.f + expf(-g))) * u);
            }
            break;
        }
        case OP_MLP_DOWN: {
            bf16* out = PP(bf16*, mout) + (size_t)l * Bm * H;
            for (int i = threadIdx.x; i < nr * B; i += NT) {
                const int r = i / B, b = i - r * B;
                out[(size_t)b * H + r0 + r] = f2bf(sOut[r * MB + b]);
            }
            break;
        }
        default: {  // OP_LM_HEAD: logits and the tile's argmax per row
            const int V = PI(V), t = rec[RF_A2];
            const float scale = PF(logit_scale);
            float* lg = PP(float*, logits);
            float* sO = reinterpret_cast<float*>(smem + SM_OUT);
            for (int i = threadIdx.x; i < nr * B; i += NT) {
                const int r = i / B, b = i - r * B;
                const float v = rbf(rbf(sO[r * MB + b]) * scale);
                sO[r * MB + b] = v;
                lg[(size_t)b * V + r0 + r] = v;
            }
            __syncthreads();
            const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
            for (int b = warp; b < B; b += NW) {
                float bv = -INFINITY;
                int bi = 0x7fffffff;
                for (int r = lane; r < nr; r += 32) {
                    const float v = sO[r * MB + b];
                    if (v > bv || (v == bv && r0 + r < bi)) { bv = v; bi = r0 + r; }
                }
                warp_argmax(bv, bi);
                if (lane == 0) {
                    float* best = PP(float*, lm_best) + ((size_t)t * Bm + b) * 2;
                    best[0] = bv;
                    best[1] = (float)bi;
                }
            }
            break;
        }
    }
    block_signal(P, rec[RF_SIG]);
    return true;
}

// ---- ARGMAX: the greedy token of every row from the LM-head tiles' maxima ---------------------------------------
__device__ bool task_argmax(const Params& P, const int* rec, int ticket) {
    if (!wait_rec(P, rec, ticket)) return false;
    const int n = rec[RF_A0], B = PI(B), Bm = PI(Bm);
    const float* best = PP(const float*, lm_best);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int b = warp; b < B; b += NW) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int t = lane; t < n; t += 32) {
            const float v = ldcg_f(best + ((size_t)t * Bm + b) * 2);
            const int i = (int)ldcg_f(best + ((size_t)t * Bm + b) * 2 + 1);
            if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
        }
        warp_argmax(bv, bi);
        if (lane == 0) PP(int*, tokens)[b] = bi;
    }
    block_signal(P, rec[RF_SIG]);
    return true;
}
