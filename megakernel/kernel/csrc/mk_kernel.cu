// The decode megakernel: one persistent launch runs every task of a decode step (see schedule.py for the task
// list and the no-deadlock argument, opcodes.py for the record layout). One block per SM; blocks claim tasks
// with one global ticket in list order; a task waits only on the counters of the tasks whose output it reads.
#include "mk_common.cuh"

#define NT MK_NUM_THREADS
#define NW MK_NUM_WARPS
#define MB MK_MAX_BATCH

extern __shared__ __align__(16) unsigned char smem[];

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
}

// ---- small accessors -----------------------------------------------------------------------------------------
__device__ __forceinline__ const int* layer_info(const Params& P, int l) {
    return PP(const int*, layer_info) + l * MK_LAYER_INFO_INTS;
}
__device__ __forceinline__ const long long* layer_wptr(const Params& P, int l) {
    return PP(const long long*, wptrs) + l * MK_WPTR_INTS;
}
__device__ __forceinline__ const int* step_in(const Params& P) { return PP(const int*, step); }

// Waits of the record (thread 0 spins; everyone gets the verdict).
__device__ __forceinline__ bool wait_rec(const Params& P, const int* rec, int ticket) {
    int ok = 1;
    if (threadIdx.x == 0) {
        for (int k = 0; k < MK_MAX_WAITS && ok; k++) {
            const int c = rec[RF_W0C + 2 * k];
            if (c >= 0) ok = wait_counter(P, c, rec[RF_W0T + 2 * k], ticket) ? 1 : 0;
        }
    }
    prof_mark(PS_WAITED);
    return __syncthreads_and(ok) != 0;
}

// Slot of sequence s's token at key position kp in group g: pointer to its K row (V is bs*KVs further).
__device__ __forceinline__ bf16* kv_slot(const Params& P, int g, int lig, int s, int kp) {
    const int Bm = PI(Bm), G = PI(n_groups), bs = PI(block_size);
    const int KVs = PI(n_kv) * PI(head_dim);
    const int* st = step_in(P);
    const int toff = st[2 * Bm + s * G + g], tbase = st[2 * Bm + Bm * G + s * G + g];
    const int blk = PP(const int*, tables)[toff + kp / bs - tbase];
    bf16* base = g == 0 ? PP(bf16*, kv0) : PP(bf16*, kv1);
    const long long nblk = g == 0 ? PL(nblk0) : PL(nblk1);
    const size_t lstride = (size_t)nblk * 2 * bs * KVs;
    return base + lig * lstride + ((size_t)blk * 2 * bs + (kp % bs)) * KVs;
}

// ---- NORM: residual add (+ MoE combine) and norm of one row ----------------------------------------------------
__device__ bool task_norm(const Params& P, const int* rec, int ticket) {
    if (!wait_rec(P, rec, ticket)) return false;
    const int l = rec[RF_LAYER], row = rec[RF_A0];
    const int H = PI(H), L = PI(L), Bm = PI(Bm), topk = PI(topk);
    float* sH = reinterpret_cast<float*>(smem);
    float* red = sH + H;
    bf16* hb = PP(bf16*, h);
    bf16* xb = PP(bf16*, x);
    if (l == 0) {
        const int tok = step_in(P)[row];
        const bf16* e = PP(const bf16*, embed) + (size_t)tok * H;
        for (int i = threadIdx.x; i < H; i += NT) sH[i] = bf2f(e[i]);
    } else {
        const int lp = l - 1;
        const int* li = layer_info(P, lp);
        const int m = li[LI_MOE_IDX], kind = li[LI_MLP_KIND];
        const bf16* hp = hb + ((size_t)lp * Bm + row) * H;
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
    const bf16* w = (l == L) ? PP(const bf16*, final_norm) : reinterpret_cast<const bf16*>(layer_wptr(P, l)[WP_NORM]);
    bf16* hout = hb + ((size_t)l * Bm + row) * H;
    bf16* xout = xb + ((size_t)l * Bm + row) * H;
    const float eps = PF(norm_eps);
    float part = 0.f;
    if (PI(norm_type) == MK_NORM_RMS) {
        for (int i = threadIdx.x; i < H; i += NT) part += sH[i] * sH[i];
        const float r = rsqrtf(block_sum(part, red) / (float)H + eps);
        for (int i = threadIdx.x; i < H; i += NT) {
            hout[i] = f2bf(sH[i]);
            xout[i] = f2bf(bf2f(w[i]) * rbf(sH[i] * r));
        }
    } else {
        for (int i = threadIdx.x; i < H; i += NT) part += sH[i];
        const float mean = block_sum(part, red) / (float)H;
        float pv = 0.f;
        for (int i = threadIdx.x; i < H; i += NT) pv += (sH[i] - mean) * (sH[i] - mean);
        const float r = rsqrtf(block_sum(pv, red) / (float)H + eps);
        for (int i = threadIdx.x; i < H; i += NT) {
            hout[i] = f2bf(sH[i]);
            xout[i] = f2bf(bf2f(w[i]) * ((sH[i] - mean) * r));
        }
    }
    block_signal(P, rec[RF_SIG]);
    return true;
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
    issue_weights(T);
    if (threadIdx.x < B) s_xrow[threadIdx.x] = xin + (size_t)threadIdx.x * xpitch;
    if (!wait_rec(P, rec, ticket)) { cp_async_wait_all(); return false; }
    load_x_and_wait(B, T.K, T.n0 + T.n1);
    gemv(T.n0 + T.n1, T.K, B);
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

// ---- attention: one split of one (sequence, kv head), on tensor cores ------------------------------------------
// K/V stream through a ring of `attn_stages` chunks of CH keys (any block boundaries inside a chunk). Each of the
// ATTN_WARPS computing warps owns one 16-key slice of every chunk and runs its own online softmax over its slices:
// S = Q K^T with mma.m16n8k16 (the kv head's <= 8 query heads as rows 0-7 of the 16-row tile, rows 8-15 zero), P
// rounded to bf16 as the A operand of O += P V (V through ldmatrix.trans), fp32 accumulation. After the last chunk
// the warps' (max, sum, output) merge through shared memory into the split's partial output and log-sum-exp.
// Layout: sK [AST][CH][d+8] bf16 | sV [AST][CH][d+8] bf16 | sQ [g][d] bf16; after the loop: sOw [ATTN_WARPS][g][d] f32 | sMw, sLw
// [ATTN_WARPS][ATTN_MAX_GROUP] f32 (schedule.attn_smem_bytes).
#define CH MK_ATTN_CHUNK
#define AST MK_ATTN_MAX_STAGES
#define AWARPS MK_ATTN_WARPS
static_assert(AWARPS * 16 == CH && AWARPS <= NW, "one 16-key slice per computing warp");
static_assert(AST <= 4, "cp_async_wait_pending covers up to 3 pending groups");

// Waits until at most `pending` of this thread's newest cp.async groups are still in flight.
__device__ __forceinline__ void cp_async_wait_pending(int pending) {
    switch (pending) {
        case 0: cp_async_wait_group<0>(); break;
        case 1: cp_async_wait_group<1>(); break;
        case 2: cp_async_wait_group<2>(); break;
        default: cp_async_wait_group<3>(); break;
    }
}

// c[0..1] += A B for rows g (0-7) of a m16n8k16 bf16 MMA whose rows 8-15 are zero: a0/a2 hold row g's columns
// (2t, 2t+1) and (2t+8, 2t+9); the pad rows' outputs are dropped.
__device__ __forceinline__ void mma_rows8(float* c, unsigned a0, unsigned a2, unsigned b0, unsigned b1) {
    float d2 = 0.f, d3 = 0.f;
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(d2), "+f"(d3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, const bf16* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
}

// KS = head_dim / 16: the MMA k-steps of Q K^T and the 16-dim pairs of P V, fixed per instantiation.
template <int KS>
__device__ __noinline__ bool task_attn_d(const Params& P, const int* rec, int ticket) {
    const int l = rec[RF_LAYER], s = rec[RF_A0], kvh = rec[RF_A1], j = rec[RF_A2], pbase = rec[RF_A3];
    const int* li = layer_info(P, l);
    const int grp = li[LI_GROUP], lig = li[LI_LIG], W = li[LI_WINDOW];
    const int d = PI(head_dim), nkv = PI(n_kv), gq = PI(n_heads) / nkv, KVs = nkv * d, Q = PI(n_heads) * d;
    const int Bm = PI(Bm), bs = PI(block_size), S = PI(split_tokens);
    const int nst = min(max(PI(attn_stages), 2), AST);
    const int p = step_in(P)[Bm + s];
    const int lo = W > 0 ? max(0, p - W + 1) : 0;
    const int k0 = lo + j * S, k1 = min(p + 1, k0 + S);
    const int rowp = d + 8;
    bf16* sK = reinterpret_cast<bf16*>(smem);
    bf16* sV = sK + AST * CH * rowp;
    const float scale = PF(attn_scale);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;     // MMA fragment coordinates: row group and thread in group

    auto chunk_len = [&](int t0) { return min(k1 - t0, CH); };
    // Keys t0 .. t0+n-1 into `stage`, one KV block segment at a time; V rows n .. n+15 of a short chunk are zeroed
    // (P is 0 there, but stale shared memory could hold NaN bit patterns and 0 * NaN is NaN).
    auto load_chunk = [&](int t0, int n, int stage) {
        const int per = d >> 3;
        for (int t = 0; t < n;) {
            const int ts = t0 + t, len = min(n - t, bs - ts % bs);
            const bf16* kb = kv_slot(P, grp, lig, s, ts) + kvh * d;
            const bf16* vb = kb + (size_t)bs * KVs;
            for (int u = threadIdx.x; u < len * per; u += NT) {
                const int r = u / per, c = u - r * per;
                cp_async16(sK + (size_t)(stage * CH + t + r) * rowp + c * 8, kb + (size_t)r * KVs + c * 8);
                cp_async16(sV + (size_t)(stage * CH + t + r) * rowp + c * 8, vb + (size_t)r * KVs + c * 8);
            }
            t += len;
        }
        const int pad = min(CH, (n + 15) / 16 * 16) - n;
        for (int u = threadIdx.x; u < pad * per; u += NT) {
            const int r = n + u / per, c = u % per;
            *reinterpret_cast<uint4*>(sV + (size_t)(stage * CH + r) * rowp + c * 8) = make_uint4(0, 0, 0, 0);
        }
        cp_async_commit();                     // every thread commits: the group counts stay uniform
    };
    int t_issue = k0, n_issued = 0;            // the next chunk to load, and how many were issued
    auto issue_next = [&]() {
        const int n = chunk_len(t_issue);
        load_chunk(t_issue, n, n_issued % nst);
        t_issue += n;
        n_issued++;
    };
    // Keys before this step's position were written by earlier launches: load them before waiting.
    while (n_issued < nst - 1 && t_issue < k1 && t_issue + chunk_len(t_issue) <= p) issue_next();
    const bool pre = n_issued > 0;
    if (pre) prof_mark(PS_ISSUED);
    if (!wait_rec(P, rec, ticket)) { cp_async_wait_all(); return false; }
    while (n_issued < nst - 1 && t_issue < k1) issue_next();
    if (!pre) prof_mark(PS_ISSUED);
    // Q of the kv head's query heads, bf16 [gq][d], after the ring: row g of the MMA's A operand
    constexpr int ksteps = KS;
    bf16* sQ = sV + AST * CH * rowp;
    const bf16* qg = PP(const bf16*, q) + ((size_t)l * Bm + s) * Q + (size_t)kvh * gq * d;
    for (int i = threadIdx.x; i < gq * d / 2; i += NT)
        reinterpret_cast<unsigned*>(sQ)[i] = __ldcg(reinterpret_cast<const unsigned*>(qg) + i);
    float m_run = -INFINITY, l_run = 0.f;      // row g's running max (scaled scores) and this thread's partial sum
    float o[2 * KS][2];                        // row g, dims nt*8 + 2t4 (+1)
#pragma unroll
    for (int nt = 0; nt < 2 * KS; nt++) o[nt][0] = o[nt][1] = 0.f;
    int t0 = k0, c = 0;
    while (t0 < k1) {
        const int n = chunk_len(t0), stage = c % nst;
        // the next chunk goes into the stage chunk c - 1 used: every thread left it at the barrier ending c - 1
        if (t_issue < k1) issue_next();
        cp_async_wait_pending(n_issued - c - 1);
        __syncthreads();
        if (c == 0) prof_mark(PS_LANDED);      // the first chunk of K/V is in shared memory
        const int kb = warp * 16;              // this warp's slice of the chunk
        if (warp < AWARPS && kb < n) {
            const bf16* kst = sK + (size_t)(stage * CH + kb) * rowp;
            float sc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};   // keys kb + nt*8 + 2t4 (+1)
#pragma unroll 2
            for (int ks = 0; ks < KS; ks++) {
                {
                    const bf16* qr = sQ + (size_t)g * d + ks * 16 + 2 * t4;
                    const unsigned qa0 = g < gq ? *reinterpret_cast<const unsigned*>(qr) : 0u;
                    const unsigned qa2 = g < gq ? *reinterpret_cast<const unsigned*>(qr + 8) : 0u;
#pragma unroll
                    for (int nt = 0; nt < 2; nt++) {
                        const bf16* kr = kst + (size_t)(nt * 8 + g) * rowp + ks * 16 + 2 * t4;
                        mma_rows8(sc[nt], qa0, qa2, *reinterpret_cast<const unsigned*>(kr),
                                  *reinterpret_cast<const unsigned*>(kr + 8));
                    }
                }
            }
            float v[4], mx = -INFINITY;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = kb + (e >> 1) * 8 + 2 * t4 + (e & 1);
                v[e] = key < n ? sc[e >> 1][e & 1] * scale : -INFINITY;
                mx = fmaxf(mx, v[e]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m_run, mx);           // finite: key kb < n is in the slice
            const float alpha = expf(m_run - m_new);
            float pr[4];
#pragma unroll
            for (int e = 0; e < 4; e++) pr[e] = expf(v[e] - m_new);
            l_run = l_run * alpha + (pr[0] + pr[1] + pr[2] + pr[3]);
            m_run = m_new;
            const unsigned pa0 = pack_bf16x2(pr[0], pr[1]), pa2 = pack_bf16x2(pr[2], pr[3]);
            const bf16* vrow = sV + (size_t)(stage * CH + kb + (lane & 7) + ((lane >> 3) & 1) * 8) * rowp + (lane >> 4) * 8;
#pragma unroll
            for (int np = 0; np < KS; np++) {
                {
                    unsigned bv[4];
                    ldsm_x4_trans(bv, vrow + np * 16);
                    o[2 * np][0] *= alpha; o[2 * np][1] *= alpha;
                    o[2 * np + 1][0] *= alpha; o[2 * np + 1][1] *= alpha;
                    mma_rows8(o[2 * np], pa0, pa2, bv[0], bv[1]);
                    mma_rows8(o[2 * np + 1], pa0, pa2, bv[2], bv[3]);
                }
            }
        }
        __syncthreads();
        t0 += n;
        c++;
    }
    // merge the computing warps (a warp that never had a key keeps max -inf, sum 0, output 0)
    float* sOw = reinterpret_cast<float*>(smem);
    float* sMw = sOw + AWARPS * gq * d;
    float* sLw = sMw + AWARPS * MK_ATTN_MAX_GROUP;
    if (warp < AWARPS) {
        l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
        l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
        if (g < gq) {
            if (t4 == 0) { sMw[warp * MK_ATTN_MAX_GROUP + g] = m_run; sLw[warp * MK_ATTN_MAX_GROUP + g] = l_run; }
            float* ow = sOw + (size_t)(warp * gq + g) * d + 2 * t4;
#pragma unroll
            for (int nt = 0; nt < 2 * KS; nt++)
                *reinterpret_cast<float2*>(ow + nt * 8) = make_float2(o[nt][0], o[nt][1]);
        }
    }
    __syncthreads();
    float* po = PP(float*, part_o) + (size_t)(pbase + j) * gq * d;
    for (int i = threadIdx.x; i < gq * d; i += NT) {
        const int h = i / d, dd = i - h * d;
        float M = -INFINITY;
        for (int w = 0; w < AWARPS; w++) M = fmaxf(M, sMw[w * MK_ATTN_MAX_GROUP + h]);
        float L = 0.f, acc = 0.f;
        for (int w = 0; w < AWARPS; w++) {
            const float e = expf(sMw[w * MK_ATTN_MAX_GROUP + h] - M);
            L += sLw[w * MK_ATTN_MAX_GROUP + h] * e;
            acc += sOw[(size_t)(w * gq + h) * d + dd] * e;
        }
        po[i] = acc / L;
        if (dd == 0) PP(float*, part_lse)[(size_t)(pbase + j) * gq + h] = M + logf(L);
    }
    block_signal(P, rec[RF_SIG]);
    return true;
}

__device__ bool task_attn(const Params& P, const int* rec, int ticket) {
    static_assert(MK_ATTN_MAX_HEAD_DIM == 128, "one instantiation per 16 dims up to 128");
    switch (PI(head_dim) >> 4) {           // check_supported: head_dim a multiple of 16, <= 128
        case 1: return task_attn_d<1>(P, rec, ticket);
        case 2: return task_attn_d<2>(P, rec, ticket);
        case 3: return task_attn_d<3>(P, rec, ticket);
        case 4: return task_attn_d<4>(P, rec, ticket);
        case 5: return task_attn_d<5>(P, rec, ticket);
        case 6: return task_attn_d<6>(P, rec, ticket);
        case 7: return task_attn_d<7>(P, rec, ticket);
        default: return task_attn_d<8>(P, rec, ticket);
    }
}

// ---- attention combine: merge the splits of one (sequence, kv head) ---------------------------------------------
__device__ bool task_combine(const Params& P, const int* rec, int ticket) {
    if (!wait_rec(P, rec, ticket)) return false;
    const int l = rec[RF_LAYER], s = rec[RF_A0], kvh = rec[RF_A1], n = rec[RF_A2], pbase = rec[RF_A3];
    const int d = PI(head_dim), nkv = PI(n_kv), gq = PI(n_heads) / nkv, Q = PI(n_heads) * d, Bm = PI(Bm);
    const float* lse = PP(const float*, part_lse) + (size_t)pbase * gq;
    const float* po = PP(const float*, part_o) + (size_t)pbase * gq * d;
    float* sMx = reinterpret_cast<float*>(smem);
    float* sDen = sMx + MK_MAX_GROUP;
    float* sWt = sDen + MK_MAX_GROUP;          // [MAXS][gq]
    const int MAXS = 256;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int h = warp; h < gq; h += NW) {
        float mx = -INFINITY;
        for (int j = lane; j < n; j += 32) mx = fmaxf(mx, ldcg_f(lse + (size_t)j * gq + h));
        mx = warp_max(mx);
        float den = 0.f;
        for (int j = lane; j < n; j += 32) den += expf(ldcg_f(lse + (size_t)j * gq + h) - mx);
        den = warp_sum(den);
        if (lane == 0) { sMx[h] = mx; sDen[h] = den; }
    }
    __syncthreads();
    float acc[MK_ATTN_OUT_PER_THREAD];
#pragma unroll
    for (int k = 0; k < MK_ATTN_OUT_PER_THREAD; k++) acc[k] = 0.f;
    for (int j0 = 0; j0 < n; j0 += MAXS) {
        const int jn = min(MAXS, n - j0);
        for (int i = threadIdx.x; i < jn * gq; i += NT) {
            const int h = i % gq;
            sWt[i] = expf(ldcg_f(lse + (size_t)j0 * gq + i) - sMx[h]) / sDen[h];
        }
        __syncthreads();
        // 8 splits' partial outputs loaded before any is used: the L2 round trips overlap instead of chaining
        for (int jj = 0; jj < jn; jj += 8) {
#pragma unroll
            for (int k = 0; k < MK_ATTN_OUT_PER_THREAD; k++) {
                const int o = threadIdx.x + k * NT;
                if (o < gq * d) {
                    const int h = o / d;
                    float v[8];
#pragma unroll
                    for (int u = 0; u < 8; u++)
                        v[u] = jj + u < jn ? ldcg_f(po + (size_t)(j0 + jj + u) * gq * d + o) : 0.f;
                    float a = acc[k];
#pragma unroll
                    for (int u = 0; u < 8; u++)
                        if (jj + u < jn) a = fmaf(sWt[(jj + u) * gq + h], v[u], a);
                    acc[k] = a;
                }
            }
        }
        __syncthreads();
    }
    bf16* out = PP(bf16*, attn) + ((size_t)l * Bm + s) * Q + (size_t)kvh * gq * d;
#pragma unroll
    for (int k = 0; k < MK_ATTN_OUT_PER_THREAD; k++) {
        const int o = threadIdx.x + k * NT;
        if (o < gq * d) out[o] = f2bf(acc[k]);
    }
    block_signal(P, rec[RF_SIG]);
    return true;
}

// ---- TOPK: routing of every row of one MoE layer, and the layer's expert queue ----------------------------------
__device__ bool task_topk(const Params& P, const int* rec, int ticket) {
    if (!wait_rec(P, rec, ticket)) return false;
    const int m = rec[RF_A0];
    const int B = PI(B), Bm = PI(Bm), E = PI(E), k = PI(topk);
    const float* rl = PP(const float*, rlog) + (size_t)m * Bm * E;
    int* route = PP(int*, route) + (size_t)m * PI(r_stride);
    float* sL = reinterpret_cast<float*>(smem);                    // [B][E]
    int* sId = reinterpret_cast<int*>(sL + MB * E);                // [B][k]
    float* sSc = reinterpret_cast<float*>(sId + MB * MK_MAX_TOPK); // [B][k]
    int* sCnt = reinterpret_cast<int*>(sSc + MB * MK_MAX_TOPK);    // [E]
    int* sSlot = sCnt + E;                                         // [E]
    int* sStart = sSlot + E;                                       // [E]
    for (int i = threadIdx.x; i < B * E; i += NT) sL[i] = ldcg_f(rl + i);
    for (int i = threadIdx.x; i < E; i += NT) sCnt[i] = 0;
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sel = PI(sel_fn), norm = PI(norm_topk);
    for (int b = warp; b < B; b += NW) {
        float* row = sL + b * E;
        for (int kk = 0; kk < k; kk++) {
            float bv = -INFINITY;
            int bi = 0x7fffffff;
            for (int e = lane; e < E; e += 32) {
                const float v = row[e];
                if (v > bv || (v == bv && e < bi)) { bv = v; bi = e; }
            }
            warp_argmax(bv, bi);
            if (bi == 0x7fffffff) bi = kk;   // all -inf / NaN: keep the queue well formed
            if (lane == 0) { sId[b * MK_MAX_TOPK + kk] = bi; sSc[b * MK_MAX_TOPK + kk] = row[bi]; row[bi] = -INFINITY; }
            __syncwarp();
        }
        if (lane == 0) {
            float* sc = sSc + b * MK_MAX_TOPK;
            if (sel == MK_SEL_SOFTMAX) {
                float mx = sc[0];
                for (int kk = 1; kk < k; kk++) mx = fmaxf(mx, sc[kk]);
                float sum = 0.f;
                for (int kk = 0; kk < k; kk++) sum += expf(sc[kk] - mx);
                for (int kk = 0; kk < k; kk++) sc[kk] = rbf(expf(sc[kk] - mx) / sum);
            } else {
                float sum = 0.f;
                for (int kk = 0; kk < k; kk++) { sc[kk] = rbf(1.f / (1.f + expf(-sc[kk]))); sum += sc[kk]; }
                if (norm) {
                    sum = rbf(sum);
                    for (int kk = 0; kk < k; kk++) sc[kk] = rbf(sc[kk] / sum);
                }
            }
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += NT) {
        int c = 0;
        for (int i = 0; i < B * k; i++) c += sId[(i / k) * MK_MAX_TOPK + i % k] == e;
        sCnt[e] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int na = 0, acc = 0;
        for (int e = 0; e < E; e++) {
            sSlot[e] = -1;
            if (sCnt[e]) {
                sSlot[e] = na;
                sStart[e] = acc;
                route[PI(r_slot_expert) + na] = e;
                route[PI(r_slot_start) + na] = acc;
                route[PI(r_slot_cnt) + na] = sCnt[e];
                acc += sCnt[e];
                na++;
            }
        }
        route[0] = na;
        route[1] = na * (PI(gu_tiles) + PI(dn_tiles));
    }
    __syncthreads();
    for (int i = threadIdx.x; i < B * k; i += NT) {
        const int b = i / k, kk = i - b * k;
        const int e = sId[b * MK_MAX_TOPK + kk];
        int before = 0;                                   // earlier rows that chose e
        for (int b2 = 0; b2 < b; b2++)
            for (int k2 = 0; k2 < k; k2++) before += sId[b2 * MK_MAX_TOPK + k2] == e;
        int rank = 0;                                     // position of e among this row's experts, ascending
        for (int k2 = 0; k2 < k; k2++) rank += sId[b * MK_MAX_TOPK + k2] < e;
        const int pi = sStart[e] + before;
        route[PI(r_pair_row) + pi] = b;
        route[PI(r_pair_rank) + pi] = rank;
        route[PI(r_pair_w) + pi] = __float_as_int(sSc[b * MK_MAX_TOPK + kk]);
        route[PI(r_topk_ids) + b * k + kk] = e;
    }
    block_signal(P, rec[RF_SIG]);
    return true;
}

// ---- profiling records (thread 0) -----------------------------------------------------------------------------
__device__ __forceinline__ void prof_record(long long* r, int op, int layer, long long arg) {
#if MK_PROFILE
    if (threadIdx.x != 0) return;
    if (s_prof[PS_LANDED] < s_prof[PS_WAITED]) s_prof[PS_LANDED] = s_prof[PS_WAITED];   // tasks that stage nothing
    if (s_prof[PS_LANDED] < s_prof[PS_ISSUED]) s_prof[PS_LANDED] = s_prof[PS_ISSUED];
    r[PF_BLOCK] = blockIdx.x; r[PF_SM] = smid(); r[PF_OP] = op; r[PF_LAYER] = layer; r[PF_ARG] = arg;
    r[PF_CLAIM] = s_prof[PS_CLAIM]; r[PF_ISSUED] = s_prof[PS_ISSUED]; r[PF_WAITED] = s_prof[PS_WAITED];
    r[PF_LANDED] = s_prof[PS_LANDED]; r[PF_END] = s_prof[PS_END];
#endif
}

__device__ __forceinline__ void prof_reset() {
#if MK_PROFILE
    if (threadIdx.x == 0) {
        const long long t = prof_now();
        for (int k = 0; k < 5; k++) s_prof[k] = t;
    }
#endif
}

// ---- MOE_WORKER: claims expert work items of one layer until the queue is empty --------------------------------
__device__ bool task_moe_worker(const Params& P, const int* rec, int ticket) {
    if (!wait_rec(P, rec, ticket)) return false;
#if MK_PROFILE
    const long long task_claim = s_prof[PS_CLAIM], task_waited = s_prof[PS_WAITED];   // thread 0's copies
#endif
    const int l = rec[RF_LAYER], m = rec[RF_A0];
    const int H = PI(H), I = PI(I), Bm = PI(Bm), topk = PI(topk), np = PI(n_pairs);
    const int gu_rows = PI(gu_rows), gu_tiles = PI(gu_tiles), dn_rows = PI(dn_rows);
    const int* route = PP(const int*, route) + (size_t)m * PI(r_stride);
    const long long* wp = layer_wptr(P, l);
    const bf16* egu = reinterpret_cast<const bf16*>(wp[WP_E_GU]);
    const bf16* edn = reinterpret_cast<const bf16*>(wp[WP_E_DOWN]);
    __shared__ int s_w[4];
    if (threadIdx.x == 0) { s_w[0] = ldcg_i(route); s_w[1] = ldcg_i(route + 1); }
    __syncthreads();
    const int n_active = s_w[0], n_items = s_w[1];
    const int n_gu = n_active * gu_tiles;
    int* work = PP(int*, moe_work) + m;
    while (true) {
        __syncthreads();
        if (threadIdx.x == 0) s_w[2] = atomicAdd(work, 1);
        __syncthreads();
        const int item = s_w[2];
        if (item >= n_items) break;
        prof_reset();
        const bool down = item >= n_gu;
        int slot, t;
        if (!down) { slot = item / gu_tiles; t = item - slot * gu_tiles; }
        else { slot = (item - n_gu) / PI(dn_tiles); t = (item - n_gu) - slot * PI(dn_tiles); }
        const int e = ldcg_i(route + PI(r_slot_expert) + slot);
        const int st = ldcg_i(route + PI(r_slot_start) + slot), cnt = ldcg_i(route + PI(r_slot_cnt) + slot);
        Tile T;
        int r0, nr;
        if (!down) {
            r0 = t * gu_rows; nr = min(gu_rows, I - r0);
            T.K = H; T.n0 = nr; T.n1 = nr;
            T.w0 = egu + ((size_t)e * 2 * I + r0) * H;
            T.w1 = egu + ((size_t)e * 2 * I + I + r0) * H;
        } else {
            r0 = t * dn_rows; nr = min(dn_rows, H - r0);
            T.K = I; T.n0 = nr; T.n1 = 0; T.w1 = nullptr;
            T.w0 = edn + ((size_t)e * H + r0) * I;
        }
        issue_weights(T);
        const int gu_ctr = l * PI(cpl) + PI(c_gu) + slot;
        if (down && !block_wait(P, gu_ctr, gu_tiles, ticket)) { cp_async_wait_all(); return false; }
        prof_mark(PS_WAITED);
        if (threadIdx.x < cnt) {
            const int i = threadIdx.x;
            s_xrow[i] = down ? PP(const bf16*, eact) + ((size_t)m * np + st + i) * I
                             : PP(const bf16*, x) + ((size_t)l * Bm + ldcg_i(route + PI(r_pair_row) + st + i)) * H;
        }
        __syncthreads();
        load_x_and_wait(cnt, T.K, T.n0 + T.n1);
        gemv(T.n0 + T.n1, T.K, cnt);
        const float* sOut = reinterpret_cast<const float*>(smem + SM_OUT);
        if (!down) {
            bf16* out = PP(bf16*, eact) + ((size_t)m * np + st) * I;
            for (int i = threadIdx.x; i < nr * cnt; i += NT) {
                const int r = i / cnt, b = i - r * cnt;
                const float g = rbf(sOut[r * MB + b]), u = rbf(sOut[(nr + r) * MB + b]);
                out[(size_t)b * I + r0 + r] = f2bf(rbf(g / (1.f + expf(-g))) * u);
            }
            block_signal(P, gu_ctr);
            prof_record(PP(long long*, prof_items) + ((size_t)m * PI(prof_items_per_layer) + item) * MK_PROF_INTS,
                        MK_PROF_ITEM_GU, l, ((long long)e << 16) | item);
        } else {
            bf16* y = PP(bf16*, y) + (size_t)m * Bm * topk * H;
            for (int i = threadIdx.x; i < nr * cnt; i += NT) {
                const int r = i / cnt, b = i - r * cnt;
                const int pi = st + b;
                const float w = __int_as_float(ldcg_i(route + PI(r_pair_w) + pi));
                const int row = ldcg_i(route + PI(r_pair_row) + pi), rank = ldcg_i(route + PI(r_pair_rank) + pi);
                y[((size_t)row * topk + rank) * H + r0 + r] = f2bf(rbf(sOut[r * MB + b]) * w);
            }
#if MK_PROFILE
            __syncthreads();
            prof_mark(PS_END);
            prof_record(PP(long long*, prof_items) + ((size_t)m * PI(prof_items_per_layer) + item) * MK_PROF_INTS,
                        MK_PROF_ITEM_DN, l, ((long long)e << 16) | item);
#endif
        }
    }
#if MK_PROFILE
    if (threadIdx.x == 0) {
        s_prof[PS_CLAIM] = task_claim;
        s_prof[PS_ISSUED] = s_prof[PS_WAITED] = s_prof[PS_LANDED] = task_waited;
    }
#endif
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

// ---- the persistent kernel ---------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NT, 1) mk_decode(const __grid_constant__ Params P) {
    __shared__ int s_rec[MK_REC_INTS];
    __shared__ int s_next, s_abort;
    int* ctrl = PP(int*, ctrl);
    const int* tasks = PP(const int*, tasks);
    const int n_tasks = PI(n_tasks);
#if MK_PROFILE
    long long* pblock = PP(long long*, prof_blocks) + (size_t)blockIdx.x * MK_PROF_BLOCK_INTS;
    if (threadIdx.x == 0) {
        // the global timer's step: read it until it moved twice
        unsigned long long a = globaltimer(), b;
        while ((b = globaltimer()) == a) {}
        unsigned long long c2;
        while ((c2 = globaltimer()) == b) {}
        pblock[PB_TIMER_STEP_NS] = (long long)(c2 - b);
        pblock[PB_G_START] = pblock[PB_C_START] = prof_now();   // stamps are ns already: the map is the identity
        pblock[PB_SM] = smid();
    }
#endif
    if (threadIdx.x == 0) s_next = atomicAdd(ctrl + CTRL_TICKET, 1);
    __syncthreads();
    while (true) {
        const int ticket = s_next;
        __syncthreads();
        if (ticket >= n_tasks) break;
        if (threadIdx.x == 0) {
            s_abort = ld_volatile(ctrl + CTRL_ABORT);
            s_next = atomicAdd(ctrl + CTRL_TICKET, 1);     // claim the next ticket early (see schedule.py)
        }
        if (threadIdx.x < MK_REC_INTS) s_rec[threadIdx.x] = __ldg(tasks + (size_t)ticket * MK_REC_INTS + threadIdx.x);
        __syncthreads();
        if (s_abort) break;
        prof_reset();
        bool ok;
        switch (s_rec[RF_OP]) {
            case OP_NORM: ok = task_norm(P, s_rec, ticket); break;
            case OP_QKV:
            case OP_OPROJ:
            case OP_ROUTER:
            case OP_MLP_GU:
            case OP_MLP_DOWN:
            case OP_LM_HEAD: ok = task_gemv(P, s_rec, ticket); break;
            case OP_ATTN: ok = task_attn(P, s_rec, ticket); break;
            case OP_ATTN_COMBINE: ok = task_combine(P, s_rec, ticket); break;
            case OP_TOPK: ok = task_topk(P, s_rec, ticket); break;
            case OP_MOE_WORKER: ok = task_moe_worker(P, s_rec, ticket); break;
            case OP_ARGMAX: ok = task_argmax(P, s_rec, ticket); break;
            default:
                if (threadIdx.x == 0) record_error(P, MK_ERR_BAD_OPCODE, ticket);
                ok = false;
        }
        if (!ok) break;
        prof_record(PP(long long*, prof) + (size_t)ticket * MK_PROF_INTS, s_rec[RF_OP], s_rec[RF_LAYER], ticket);
    }
    __syncthreads();
#if MK_PROFILE
    if (threadIdx.x == 0) {
        pblock[PB_G_END] = pblock[PB_C_END] = prof_now();
    }
#endif
    if (threadIdx.x == 0) atomicAdd(ctrl + CTRL_DONE_BLOCKS, 1);
}

// ---- host entry points (ctypes) ------------------------------------------------------------------------------------
extern "C" int mk_num_params() { return MK_NUM_PARAMS; }

extern "C" const char* mk_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }

extern "C" int mk_device_info(int device, int* out) {
    cudaDeviceProp prop;
    cudaError_t e = cudaGetDeviceProperties(&prop, device);
    if (e != cudaSuccess) return (int)e;
    out[0] = prop.multiProcessorCount;
    out[1] = prop.major;
    out[2] = prop.minor;
    out[3] = (int)prop.sharedMemPerBlockOptin;
    return 0;
}

// Zeroes the control block and counters, then launches the step, all on `stream`.
extern "C" int mk_launch(int device, const long long* params, int grid, int smem_bytes, void* sync_ptr,
                         long long sync_bytes, void* stream) {
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return (int)e;
    Params P;
    for (int i = 0; i < MK_NUM_PARAMS; i++) P.v[i] = params[i];
    e = cudaFuncSetAttribute(mk_decode, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (e != cudaSuccess) return (int)e;
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    e = cudaMemsetAsync(sync_ptr, 0, (size_t)sync_bytes, st);
    if (e != cudaSuccess) return (int)e;
    mk_decode<<<grid, NT, smem_bytes, st>>>(P);
    return (int)cudaGetLastError();
}
