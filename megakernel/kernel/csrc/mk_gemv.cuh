// GEMV: the static projection tasks (QKV with RoPE and the K/V append, O, router, dense/shared MLP, a one-tile LM
// head task) on the loader (mk_loader.cuh) and the cores (mk_gemv_core.cuh). The streaming LM head and ARGMAX:
// mk_lm_head.cuh.
#pragma once
#include "mk_common.cuh"
#include "mk_norm.cuh"      // residual_row / norm_row: tiles with FLAG_FUSED_NORM normalise their own inputs
#include "mk_gemv_core.cuh"
#include "mk_routing.cuh"   // router_topk plans: the last router tile of a layer routes it

// ---- static GEMV tasks ---------------------------------------------------------------------------------------
__device__ __forceinline__ bool is_gemv_op(int op) {
    return op == OP_QKV || op == OP_OPROJ || op == OP_ROUTER || op == OP_MLP_GU || op == OP_MLP_DOWN || op == OP_LM_HEAD;
}

// The O projection's tile of rows r0..r0+nr, from its weights wo ([H][q_dim]); static_tile's and an O item's.
__device__ __forceinline__ Tile oproj_tile(const Params& P, const bf16* wo, int r0, int nr) {
    Tile T;
    T.K = PI(q_dim); T.w0 = wo + (size_t)r0 * T.K; T.n0 = nr; T.w1 = nullptr; T.n1 = 0;
    return T;
}

#ifndef MK_LATE_WEIGHTS
#define MK_LATE_WEIGHTS 0
#endif

// The weight tile of a static GEMV record (op, layer, first row, rows) and, if wanted, where its input rows start.
__device__ __forceinline__ Tile static_tile(const Params& P, int op, int l, int r0, int nr, const bf16** xin = nullptr,
                                            int* xpitch = nullptr) {
    const int H = PI(H), Bm = PI(Bm), L = PI(L);
    const int Q = PI(q_dim);
    const long long* wp = l < L ? layer_wptr(P, l) : nullptr;
    Tile T;
    T.w1 = nullptr;
    T.n1 = 0;
    T.n0 = nr;
    const bf16* x;
    int pitch = H;
    switch (op) {
        case OP_QKV:
            T.K = H; T.w0 = reinterpret_cast<const bf16*>(wp[WP_QKV]) + (size_t)r0 * H;
            x = PP(const bf16*, x) + (size_t)l * Bm * H;
            break;
        case OP_OPROJ:
            T = oproj_tile(P, reinterpret_cast<const bf16*>(wp[WP_O]), r0, nr);
            x = PP(const bf16*, attn) + (size_t)l * Bm * Q; pitch = Q;
            break;
        case OP_ROUTER:
            T.K = H; T.w0 = reinterpret_cast<const bf16*>(wp[WP_ROUTER]) + (size_t)r0 * H;
            x = PP(const bf16*, x) + (size_t)l * Bm * H;
            break;
        case OP_MLP_GU: {
            const int width = layer_info(P, l)[LI_MLP_WIDTH];
            const bf16* w = reinterpret_cast<const bf16*>(wp[WP_MLP_GU]);
            T.K = H; T.w0 = w + (size_t)r0 * H; T.w1 = w + (size_t)(width + r0) * H; T.n1 = nr;
            x = PP(const bf16*, x) + (size_t)l * Bm * H;
            break;
        }
        case OP_MLP_DOWN: {
            const int width = layer_info(P, l)[LI_MLP_WIDTH];
            T.K = width; T.w0 = reinterpret_cast<const bf16*>(wp[WP_MLP_DOWN]) + (size_t)r0 * width;
            x = PP(const bf16*, mact) + (size_t)l * Bm * PI(I_mlp); pitch = PI(I_mlp);
            break;
        }
        default:  // OP_LM_HEAD
            T.K = H; T.w0 = PP(const bf16*, lm_head) + (size_t)r0 * H;
            x = PP(const bf16*, x) + (size_t)L * Bm * H;
            break;
    }
    if (xin) *xin = x;
    if (xpitch) *xpitch = pitch;
    return T;
}

// All threads: with two weight buffers, issue the tile of the block's next ticket into buffer `buf` if that task is a
// GEMV (its record is read here; the loop reads it again when it runs it) and record it in s_pf_ticket / s_pf_buf.
__device__ __forceinline__ void prefetch_next(const Params& P, int buf) {
    const int next = s_next;
    if (!PI(wbuf) || !PI(claim_ahead) || next >= PI(n_tasks)) return;   // (s_next is the next ticket only then)
    const int* r = PP(const int*, tasks) + (size_t)next * MK_REC_INTS;
#if MK_EARLY_TABLES
    // op, layer, a0, a1 in one 16-byte load (records are 64-byte aligned): the tile's fields no longer wait for
    // the op's round trip before they are asked for
    static_assert(RF_OP == 0 && RF_LAYER == 1 && RF_A0 == 2 && RF_A1 == 3, "the record's first four fields");
    const int4 head = __ldg(reinterpret_cast<const int4*>(r));
    const int op = head.x;
    if (!is_gemv_op(op)) return;
    const Tile T = static_tile(P, op, head.y, head.z, head.w);
#else
    const int op = __ldg(r + RF_OP);
    if (!is_gemv_op(op)) return;
    const Tile T = static_tile(P, op, __ldg(r + RF_LAYER), __ldg(r + RF_A0), __ldg(r + RF_A1));
#endif
    if ((size_t)(T.n0 + T.n1) * row_pitch(T.K) * 2 > (size_t)PI(wbuf)) return;   // the plan keeps tiles in a buffer
    issue_weights(P, T, buf);
    if (threadIdx.x == 0) { s_pf_ticket = next; s_pf_buf = buf; }
}

// The O projection's rows r0..r0+nr of every row of the step (in sOut) plus the bias, into ao (a static OPROJ task
// and an O item of the expert queue share it).
template <int NTHREADS = NT>   // threads 0..NTHREADS-1
__device__ __forceinline__ void oproj_epilogue(const Params& P, int l, int r0, int nr) {
    const int H = PI(H), B = PI(B);
    const float* sOut = reinterpret_cast<const float*>(smem + SM_OUT);
    const bf16* bias = reinterpret_cast<const bf16*>(layer_wptr(P, l)[WP_O_BIAS]);
    bf16* out = PP(bf16*, ao) + (size_t)l * PI(Bm) * H;
    for (int i = threadIdx.x; i < nr * B; i += NTHREADS) {
        const int r = i / B, b = i - r * B;
        float v = sOut[r * MB + b];
        if (bias) v += bf2f(bias[r0 + r]);
        out[(size_t)b * H + r0 + r] = f2bf(v);
    }
}

// ---- LM head ---------------------------------------------------------------------------------------------------
static_assert(MB <= NW, "the LM head keeps row b's running maximum in warp b");

// LM-head rows r0..r0+nr of every row of the step (in sOut): the scaled logits into `logits`, and each row's best
// (value, vocab index) folded into bv / bi of warp b for row b (every lane holds it). Ties go to the smaller index.
__device__ __forceinline__ void lm_epilogue(const Params& P, int r0, int nr, float& bv, int& bi) {
    const int V = PI(V), B = PI(B);
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
    if (warp < B) {
        float tv = -INFINITY;
        int ti = 0x7fffffff;
        for (int r = lane; r < nr; r += 32) {
            const float v = sO[r * MB + warp];
            if (v > tv || (v == tv && r0 + r < ti)) { tv = v; ti = r0 + r; }
        }
        warp_argmax(tv, ti);
        if (tv > bv || (tv == bv && ti < bi)) { bv = tv; bi = ti; }
    }
}

// Lane 0 of warp b: row b's maximum of LM-head task t.
__device__ __forceinline__ void lm_store_best(const Params& P, int t, float bv, int bi) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp < PI(B) && lane == 0) {
        float* best = PP(float*, lm_best) + ((size_t)t * PI(Bm) + warp) * 2;
        best[0] = bv;
        best[1] = (float)bi;
    }
}

// Whether a FLAG_FUSED_NORM tile keeps each row's residual in registers (residual_norm_fused: 8 columns per thread,
// no shared memory beyond the block sum's NW floats in the GEMV scratch) or stages it in fp32 after the inputs
// (residual_row + norm_row: (H + NW) * 4 bytes more). plan.fused_norm_smem_bytes is the host's side of this.
#if MK_SMALL_VEC >= 2
#define FUSED_NORM_IN_REGS(H) ((H) % 8 == 0 && ((H) >> 3) <= NT)
#else
#define FUSED_NORM_IN_REGS(H) false
#endif

// Shared memory a FLAG_FUSED_NORM tile needs after its inputs: the fp32 residual row and a block sum's scratch where
// the row is staged, none where it stays in registers.
__device__ __forceinline__ size_t fused_staged_bytes(int H) { return FUSED_NORM_IN_REGS(H) ? 0 : (size_t)(H + NW) * 4; }

// A FLAG_FUSED_NORM tile's input rows, staged: every row's residual (in sH) and norm into sX, and with FLAG_WRITE_H /
// FLAG_WRITE_X the residual / normed rows to global memory for the tasks that read them. Not inlined: the
// vectorised residual's registers would spill in the persistent loop.
__device__ __noinline__ void fused_inputs(const Params& P, int l, int flags, bf16* sX, float* sH, int pitch) {
    const int H = PI(H), Bm = PI(Bm), B = PI(B);
    for (int b = 0; b < B; b++) {
        residual_row(P, l, b, sH);
        bf16* hdst = (flags & MK_FLAG_WRITE_H) ? PP(bf16*, h) + ((size_t)l * Bm + b) * H : nullptr;
        norm_row(P, l, sH, sH + H, sX + (size_t)b * pitch, hdst);
        if (flags & MK_FLAG_WRITE_X) {      // the same columns per thread as norm_row wrote: no barrier
            bf16* xg = PP(bf16*, x) + ((size_t)l * Bm + b) * H;
            const bf16* xs = sX + (size_t)b * pitch;
            for (int c = threadIdx.x; c < H / NORM_COLS_PER_THREAD; c += NT)
#pragma unroll
                for (int j = 0; j < NORM_COLS_PER_THREAD; j++)
                    xg[c * NORM_COLS_PER_THREAD + j] = xs[c * NORM_COLS_PER_THREAD + j];
        }
        __syncthreads();                    // sH is the next row's
    }
}

#if MK_SMALL_VEC >= 2
// fused_inputs where FUSED_NORM_IN_REGS(H): each row's residual in registers (residual_norm_fused), the block sum
// in the GEMV's reduction scratch (idle until gemv()). A function of its own: folded into fused_inputs, its
// registers made the persistent loop spill in the (since removed) MK_TOPK_PACKED=0 build.
// (MK_FUSED_TABLES_EARLY=1: the norm's tables come from the caller, read before its wait; 0: read here, after it,
// so the default build's task_gemv holds no registers for them across the wait.)
#if MK_FUSED_TABLES_EARLY
__device__ __noinline__ void fused_inputs_regs(const Params& P, int l, int flags, bf16* sX, int pitch,
                                              NormTables t) {
#else
__device__ __noinline__ void fused_inputs_regs(const Params& P, int l, int flags, bf16* sX, int pitch) {
    const NormTables t = norm_tables(P, l);
#endif
    const int H = PI(H), Bm = PI(Bm), B = PI(B);
    float* red = reinterpret_cast<float*>(smem + SM_RED);
    for (int b = 0; b < B; b++) {
        bf16* hdst = (flags & MK_FLAG_WRITE_H) ? PP(bf16*, h) + ((size_t)l * Bm + b) * H : nullptr;
        bf16* xs = sX + (size_t)b * pitch;
        residual_norm_fused<true>(P, l, b, t, red, xs, hdst);
        if ((flags & MK_FLAG_WRITE_X) && threadIdx.x < (H >> 3))   // the 8 columns this thread normed
            reinterpret_cast<uint4*>(PP(bf16*, x) + ((size_t)l * Bm + b) * H)[threadIdx.x] =
                reinterpret_cast<const uint4*>(xs)[threadIdx.x];
    }
    // (no barrier: wait_weights' publishes sX before the GEMV reads it, as after load_x; `red` is not written again)
}
#endif

// One thread of a QKV tile of rows r0..r0+nr of layer l (ModelPlan.l2_prefetch): the same share of the layer's O
// weights (rows * H / total, 16-byte aligned, so the tiles cover the matrix) and/or of the next layer's QKV rows
__device__ __noinline__ void l2_prefetch_shares(const Params& P, int l, int r0, int nr) {
    const int bits = PI(l2_pf), H = PI(H), Q = PI(q_dim), L = PI(L);
    const unsigned long long pol = l2_policy_prefetched(bits & MK_L2PF_EVICT_LAST);
    const long long rows = Q + 2 * PI(n_kv) * PI(head_dim);
    if (bits & MK_L2PF_OPROJ) {
        const long long total = (long long)H * Q * 2;   // bytes of the O weights
        const long long a = (total * r0 / rows) & ~15LL, b = (total * (r0 + nr) / rows) & ~15LL;
        const char* w = reinterpret_cast<const char*>(layer_wptr(P, l)[WP_O]);
        if (b > a) l2_prefetch_bulk(w + a, (unsigned)(b - a), pol);
    }
    if ((bits & MK_L2PF_NEXT_QKV) && l + 1 < L) {
        const char* w = reinterpret_cast<const char*>(layer_wptr(P, l + 1)[WP_QKV]);
        l2_prefetch_bulk(w + (size_t)r0 * H * 2, (unsigned)nr * H * 2, pol);
    }
}

// Weights first (this task's, unless prefetched, then the next task's), then the waits, then the inputs, then the
// math and the task's epilogue. pf_buf: the buffer the previous task issued this task's weights into (-1: none).
__device__ bool task_gemv(const Params& P, const int* rec, int ticket, int pf_buf) {
    const int op = rec[RF_OP], l = rec[RF_LAYER], r0 = rec[RF_A0], nr = rec[RF_A1];
    const int H = PI(H), Bm = PI(Bm), B = PI(B), L = PI(L);
    const int Q = PI(q_dim);
    const long long* wp = l < L ? layer_wptr(P, l) : nullptr;
    const int* li = l < L ? layer_info(P, l) : nullptr;
    const bf16* xin;
    int xpitch;
    const Tile T = static_tile(P, op, l, r0, nr, &xin, &xpitch);
    const int flags = rec[RF_FLAGS];
    const bool fused = (flags & MK_FLAG_FUSED_NORM) != 0;      // QKV / ROUTER / MLP_GU only: K == H
    const int R = T.n0 + T.n1;
    const size_t x_end = sm_x_end(P, R, T.K, B);
    if (!smem_fits(P, x_end + (fused ? fused_staged_bytes(H) : 0), ticket)) { drain_weights(); return false; }
    int buf = 0;
    // FLAG_LATE_WEIGHTS (plan knob qkv_late_weights, in builds with MK_LATE_WEIGHTS=1): the weights after the input
    // rows are read, below (a switch, so the default build's code stays the one measured until the knob is)
    const bool late = MK_LATE_WEIGHTS && pf_buf < 0 && (flags & MK_FLAG_LATE_WEIGHTS) != 0;
    if (pf_buf >= 0) {
        buf = pf_buf;                        // issued by the previous task: `issued` stays at the claim
    } else if (!late) {
        issue_weights(P, T, buf);
        prof_mark(PS_ISSUED);
    }
    prefetch_next(P, buf ^ 1);
    if (op == OP_QKV && threadIdx.x == 32 && (PI(l2_pf) & (MK_L2PF_OPROJ | MK_L2PF_NEXT_QKV))
        && !(PI(l2_pf) & MK_L2PF_AFTER_GEMV))
        l2_prefetch_shares(P, l, r0, nr);
    if (!fused && threadIdx.x < B) s_xrow[threadIdx.x] = xin + (size_t)threadIdx.x * xpitch;
#if MK_SMALL_VEC >= 2
    // MK_FUSED_TABLES_EARLY=1: the fused norm's tables read before the wait, into registers (their loads in flight
    // while thread 0 spins), not after it (session 26's form, thread 0 reading them into shared memory before its
    // spin, measured 7-8% slower and was removed)
#if MK_FUSED_TABLES_EARLY
    NormTables nt{};
    if (fused) nt = norm_tables(P, l);
#define MK_FUSED_TABLES_ARG , nt
#else
#define MK_FUSED_TABLES_ARG
#endif
#endif
    if (!wait_rec(P, rec, ticket)) { drain_weights(); return false; }
    if (fused) {       // the rows' residual and norm straight into sX (the weights keep landing meanwhile)
        bf16* sX = reinterpret_cast<bf16*>(smem + sm_x(P, R, T.K));
#if MK_SMALL_VEC >= 2
        if (FUSED_NORM_IN_REGS(H))
        {
            fused_inputs_regs(P, l, flags, sX, row_pitch(T.K) MK_FUSED_TABLES_ARG);
#if MK_PROFILE && MK_FUSED_SERIAL == 4
            prof_phase(1);                   // the first pass's end; "inputs ready" (mark 0) is the second's
            fused_inputs_regs(P, l, flags, sX, row_pitch(T.K) MK_FUSED_TABLES_ARG);
#endif
        }
        else
#undef MK_FUSED_TABLES_ARG
#endif
            fused_inputs(P, l, flags, sX, reinterpret_cast<float*>(smem + x_end), row_pitch(T.K));
    } else {
        load_x(reinterpret_cast<bf16*>(smem + sm_x(P, R, T.K)), B, T.K);
    }
    prof_phase(0);                           // (thread 0's rows stored: the loads have landed)
    if (late) {                              // (buffer 0 had no copy pending: an abort above drained only a prefetch)
        issue_weights(P, T, buf);
        prof_mark(PS_ISSUED);
    }
    wait_weights(buf);
    gemv(P, buf, R, T.K, B);
    if (op == OP_QKV && threadIdx.x == 32 && (PI(l2_pf) & (MK_L2PF_OPROJ | MK_L2PF_NEXT_QKV))
        && (PI(l2_pf) & MK_L2PF_AFTER_GEMV))
        l2_prefetch_shares(P, l, r0, nr);    // (in the routing window, the layer's QKV copies landed)
#if MK_PROFILE && MK_FUSED_SERIAL == 4
    if (fused) {                             // mark 2: the first GEMV's end; "computed" is the second's
        if (threadIdx.x == 0) s_pmark[2] = s_prof[PS_COMPUTED];
        gemv(P, buf, R, T.K, B);
    }
#endif
    const float* sOut = reinterpret_cast<const float*>(smem + SM_OUT);
    switch (op) {
        case OP_QKV: {
            const int d = PI(head_dim), KVs = PI(n_kv) * d;
            const bf16* bias = reinterpret_cast<const bf16*>(wp[WP_QKV_BIAS]);
            const int region = r0 < Q ? 0 : (r0 < Q + KVs ? 1 : 2);
            // (a tile stays inside one kv head's Q, K or V rows, but may span two of its query heads:
            // schedule.qkv_tiles; each pair's head and dimension are its own)
            const int rel = r0 - (region == 0 ? 0 : (region == 1 ? Q : Q + KVs));
            const bool rope = li[LI_USES_ROPE] && region < 2;
            const float* inv_freq = PP(const float*, inv_freq);
            const int* pos = step_in(P) + Bm;
            for (int i = threadIdx.x; i < (nr / 2) * B; i += NT) {
                const int pr = i / B, b = i - pr * B, r = 2 * pr;
                const int head = (rel + r) / d, dd = rel + r - head * d;
                float v0 = sOut[r * MB + b], v1 = sOut[(r + 1) * MB + b];
                if (bias) { v0 += bf2f(bias[r0 + r]); v1 += bf2f(bias[r0 + r + 1]); }
                v0 = rbf(v0); v1 = rbf(v1);
                if (rope) {
                    const float ang = (float)pos[b] * inv_freq[dd >> 1];
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
                          + head * d + dd;
                }
                dst[0] = f2bf(v0);
                dst[1] = f2bf(v1);
            }
            break;
        }
        case OP_OPROJ:
            oproj_epilogue(P, l, r0, nr);
            break;
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
        default: {  // OP_LM_HEAD (one tile): logits and the tile's argmax per row
            float bv = -INFINITY;
            int bi = 0x7fffffff;
            lm_epilogue(P, r0, nr, bv, bi);
            lm_store_best(P, rec[RF_A2], bv, bi);
            break;
        }
    }
    if (op == OP_ROUTER && rec[RF_A3] > 0) return router_signal_route(P, rec, ticket, li[LI_MOE_IDX]);
    task_signal(P, rec[RF_SIG]);
    return true;
}
