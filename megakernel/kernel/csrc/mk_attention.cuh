// Decode attention: one split of one (sequence, kv head) on tensor cores, and the combine of its splits.
#pragma once
#include "mk_common.cuh"
#include "mk_attn_layout.cuh"
#include "mk_attn_math.cuh"

// ---- attention: one split of one (sequence, kv head), on tensor cores ------------------------------------------
// K/V stream through a ring of `attn_stages` chunks of CH keys (any block boundaries inside a chunk). Each of the
// ATTN_WARPS computing warps (or, MK_ATTN_DSPLIT, pair of warps: half the head dims each) owns one 16-key slice of
// every chunk and runs its own online softmax over its slices:
// S = Q K^T with mma.m16n8k16 (the kv head's <= 8 query heads as rows 0-7 of the 16-row tile, rows 8-15 zero), P
// rounded to bf16 as the A operand of O += P V (V through ldmatrix.trans), fp32 accumulation. After the last chunk
// the warps' (max, sum, output) merge through shared memory into the split's partial output and log-sum-exp.
// Layout: sK [AST][CH][d+8] bf16 | sV [AST][CH][d+8] bf16 | sQ [g][d(+8)] bf16 (mk_attn_layout.cuh); after the loop:
// sOw [ATTN_WARPS][g][d(+8)] f32 | sMw, sLw [ATTN_WARPS][ATTN_MAX_GROUP] f32 (plan.attn_smem_bytes).
#define CH MK_ATTN_CHUNK
#define AST MK_ATTN_MAX_STAGES
#define AWARPS MK_ATTN_WARPS
static_assert(AWARPS * 16 == CH && AWARPS <= NW, "one 16-key slice per computing warp");
static_assert(!MK_ATTN_DSPLIT || 2 * AWARPS <= NW, "MK_ATTN_DSPLIT: two computing warps per 16-key slice");
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

// The attention ring's mbarriers (one per stage; the bulk-copy paths, MK_ATTN_BULK >= 1) and their phases (bit st: the
// parity of stage st's next completion), kept across tasks: initialised once per launch (init_attention_ring), every
// copy waited for before its task ends, so each barrier's phase is known at the next attention task's start.
__shared__ __align__(8) unsigned long long s_abar[AST];
__shared__ unsigned s_aphase;

// Thread 0, once per launch before the first barrier (builds whose attention loads by cp.async never use them).
__device__ __forceinline__ void init_attention_ring() {
#if MK_ATTN_BULK
    for (int st = 0; st < AST; st++) mbar_init(&s_abar[st], 1);
    s_aphase = 0;
    fence_mbar_init();
#endif
}


#define ATM_BOX 16   // keys per tensor copy (MK_ATTN_BULK=2): the host encodes the KV maps with boxes of 16 rows

// Byte offset of (row r, column c) in a tensor-copied K or V chunk (TM layout): 16-row boxes, each [column block of
// 64][16 rows][64 columns] with the 128-byte swizzle (16-byte chunk j of a 128-byte line stored at j ^ (line & 7);
// the chunk's base is 1024-byte aligned and a box is 16 lines per column block, so line & 7 = r & 7). NCB = d / 64.
template <int NCB>
__device__ __forceinline__ int tm_off(int r, int c) {
    const int line = ((r >> 4) * NCB + (c >> 6)) * ATM_BOX + (r & 15);
    return line * 128 + ((((c & 63) >> 3) ^ (r & 7)) << 4) + (c & 7) * 2;
}

// Where attn_chunk_math finds K and V in a tensor-copied chunk (MK_ATTN_BULK=2): K at kst, V at shared address vst,
// both in tm_off's swizzled layout (the padded-row layouts: mk_attn_math.cuh's AttnKVPadded). No k_addr: the
// tensor-copy path runs the math with FAST off.
template <int NCB>
struct AttnKVTensor {
    const unsigned char* kst;
    unsigned vst;
    __device__ __forceinline__ unsigned k_word(int r, int c) const {
        return *reinterpret_cast<const unsigned*>(kst + tm_off<NCB>(r, c));
    }
    __device__ __forceinline__ unsigned v_addr(int r, int c) const { return vst + tm_off<NCB>(r, c); }
};

// KS = head_dim / 16: the MMA k-steps of Q K^T and the 16-dim pairs of P V, fixed per instantiation. TM: K/V chunks
// by tensor copies of 16-key boxes through the host's KV maps (MK_ATTN_BULK=2, head_dim a multiple of 64, blocks
// of a multiple of 16 keys), into the swizzled layout above; else rows padded by 8 elements (d + 8), loaded by one
// bulk copy per row (MK_ATTN_BULK=1) or 16-byte cp.async (0).
template <int KS, bool TM, bool DSPLIT>
__device__ __noinline__ bool task_attn_d(const Params& P, const int* rec, int ticket) {
    constexpr bool BULK = TM || MK_ATTN_BULK == 1;
    constexpr int NCB = KS / 4;                // TM: 64-column blocks of a row
    const int l = rec[RF_LAYER], s = rec[RF_A0], kvh = rec[RF_A1], j = rec[RF_A2], pbase = rec[RF_A3];
    const int* li = layer_info(P, l);
#if MK_EARLY_TABLES && !MK_CONST_TABLES
    // one wave of loads: the layer's group, pool index and window (one 16-byte load), this row's position, and its
    // block-table offsets in every KV group (n_groups <= 2; kv_table_off's two loads each), picked once grp lands
    static_assert(LI_GROUP == 1 && LI_LIG == 2 && LI_WINDOW == 3, "layer info's fields 1..3 in one load");
    const int4 lh = ld_now_v4(li);
    const int grp = lh.y, lig = lh.z, W = lh.w;
    const int p = ld_now(step_in(P) + PI(Bm) + s);
    const int G = PI(n_groups);
    const int* te = kv_table_entries(P, s);
    const int tb = kv_table_base_stride(P);
    const int ta0 = ld_now(te), tb0 = ld_now(te + tb);
    const int ta1 = G > 1 ? ld_now(te + 1) : 0, tb1 = G > 1 ? ld_now(te + tb + 1) : 0;
    const int tab_off = grp == 0 ? ta0 - tb0 : ta1 - tb1;    // (kv_table_off's difference, for the group)
#else
    const int grp = li[LI_GROUP], lig = li[LI_LIG], W = li[LI_WINDOW];
#endif
    // head_dim is 16 * KS (task_attn picks KS from it): a constant here, so the copies' row and column arithmetic
    // compiles to shifts (as PI(head_dim), each 16-byte copy's u / per was a full division: ~22 instructions per copy)
    constexpr int d = 16 * KS;
    constexpr int QPAD = MK_ATTN_PAD ? MK_ATTN_ROW_PAD : 0;     // after each of Q's rows (mk_attn_layout.cuh)
    constexpr int MPAD = MK_ATTN_PAD ? MK_ATTN_MERGE_PAD : 0;   // after each of the merge's rows
    const int nkv = PI(n_kv), gq = PI(n_heads) / nkv, KVs = nkv * d, Q = PI(n_heads) * d;
    const int Bm = PI(Bm), bs = PI(block_size), S = PI(split_tokens);
    const int nst = min(max(PI(attn_stages), 2), AST);
#if !(MK_EARLY_TABLES && !MK_CONST_TABLES)
    const int p = step_in(P)[Bm + s];
#endif
    const int lo = W > 0 ? max(0, p - W + 1) : 0;
    const int k0 = lo + j * S, k1 = min(p + 1, k0 + S);
    constexpr int rowp = d + MK_ATTN_ROW_PAD;
    bf16* sK = reinterpret_cast<bf16*>(smem);
    bf16* sV = sK + AST * CH * rowp;
    const float scale = PF(attn_scale);
    const size_t ring = (size_t)2 * AST * CH * rowp * 2 + (size_t)gq * q_pitch<d, QPAD>() * 2 + MK_ATTN_TABLE_SLOTS * 4;
    const size_t merge = (size_t)AWARPS * gq * merge_pitch<d, MPAD>() * 4 + (size_t)2 * AWARPS * MK_ATTN_MAX_GROUP * 4;
    if (!smem_fits(P, ring > merge ? ring : merge, ticket)) return false;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;     // MMA fragment coordinates: row group and thread in group
    // TM: the tensor-copied chunks (1024-byte aligned, unpadded: inside the padded ring's footprint)
    const unsigned tm_k = TM ? (unsigned)swz_align(0) : 0u;
    const unsigned tm_v = tm_k + (unsigned)(AST * CH * d * 2);

    // The split's block-table entries, read once (one L2 round trip for all of them) instead of per chunk segment
    // (kv_slot: two dependent global loads in front of each segment's copies). step_inputs keeps a split's blocks
    // within MK_ATTN_TABLE_SLOTS.
    bf16* sQ = sV + AST * CH * rowp;           // [gq][d + QPAD], after the ring
    int* sBlk = reinterpret_cast<int*>(sQ + gq * q_pitch<d, QPAD>());
    const int blk0 = k0 / bs, nblk = k1 > k0 ? (k1 - 1) / bs - blk0 + 1 : 0;
    // MK_ATTN_TABLE: the cp.async path reads them up front too, before its wait (else it looks each KV block segment
    // up as it goes: kv_slot's table load in front of the segment's copies)
    constexpr bool tab_smem = BULK || MK_ATTN_TABLE;
    if (tab_smem && nblk > MK_ATTN_TABLE_SLOTS) {
        if (threadIdx.x == 0) record_error(P, MK_ERR_SMEM, ticket, -1, nblk, MK_ATTN_TABLE_SLOTS);
        return false;
    }
    if (tab_smem) {
#if MK_EARLY_TABLES && !MK_CONST_TABLES
        const int* tab = PP(const int*, tables) + tab_off + blk0;
#else
        const int* tab = PP(const int*, tables) + kv_table_off(P, grp, s) + blk0;
#endif
        for (int i = threadIdx.x; i < nblk; i += NT) sBlk[i] = tab[i];
        if (TM && threadIdx.x < 32)            // host-written maps: acquired by the tensor-map proxy
            tensormap_acquire(PP(const unsigned char*, kv_tmaps) + (size_t)grp * MK_TMAP_BYTES);
        __syncthreads();
    }
    const bf16* kv_base = kv_layer_base(P, grp, lig) + kvh * d;
    auto key_row = [&](int ts) -> const bf16* {     // key ts's K row of this kv head (V: bs * KVs further)
        return kv_base + ((size_t)sBlk[ts / bs - blk0] * 2 * bs + ts % bs) * KVs;
    };

    // TM chunks start on 16-key boundaries (a box never crosses a KV block): keys before k0 in the first chunk and
    // from k1 on in the last are loaded but masked, their V rows zeroed after landing.
    const int a0 = TM ? k0 & ~(ATM_BOX - 1) : k0;
    auto chunk_len = [&](int t0) { return min(k1 - t0, CH); };
    unsigned ph = BULK ? s_aphase : 0u; // bit st: the parity of stage st's next completion
    // MK_ATTN_ISSUE=1 on the bulk path: the one-warp variant's copies by the warps that do not compute (ISSUE_IDLE),
    // and no block barrier between a chunk's wait and its math after the first chunk (LAP_SYNC0): each thread
    // waits on the stage's mbarrier itself, which makes the copies visible to it, and the pad rows were zeroed and
    // published laps earlier, so the barrier only held every warp for the slowest; at chunk 0 it publishes Q. The
    // computing warps then wait and compute while the others issue the next chunk, two chunks in flight as before.
    constexpr bool ISSUE_IDLE = MK_ATTN_ISSUE && BULK && !TM && !(DSPLIT && KS % 2 == 0);
    constexpr bool LAP_SYNC0 = MK_ATTN_ISSUE && BULK && !TM;
    auto load_chunk = [&](int t0, int n, int stage) {
        if constexpr (TM) {
            // warp 0: lane 0 arms the stage with the boxes' bytes, lanes 0 .. 2 * nbox - 1 copy a box each
            if (warp == 0) {
                unsigned long long* bar = &s_abar[stage];
                const int nbox = (n + ATM_BOX - 1) / ATM_BOX;
                if (lane == 0) mbar_expect_tx(bar, (unsigned)(2 * nbox * ATM_BOX * d * 2));
                fence_proxy_async();
                const void* map = PP(const unsigned char*, kv_tmaps) + (size_t)grp * MK_TMAP_BYTES;
                const long long nb = grp == 0 ? PL(nblk0) : PL(nblk1);
                for (int i = lane; i < 2 * nbox; i += 32) {
                    const int v = i >= nbox, q = v ? i - nbox : i, ts = t0 + q * ATM_BOX;
                    const long long row = (((long long)lig * nb + sBlk[ts / bs - blk0]) * 2 + v) * bs + ts % bs;
                    bulk_tensor_3d(smem + (v ? tm_v : tm_k) + (size_t)stage * CH * d * 2 + (size_t)q * ATM_BOX * d * 2,
                                   map, 0, (int)row, kvh * NCB, bar, l2_evict_first());
                }
            }
        } else if constexpr (BULK) {
            // one bulk copy (TMA) per K row and per V row, completing on the stage's mbarrier (the first issuing
            // thread arms it; copies that land before the arm take the count below zero, and the phase cannot
            // complete before that thread's arrival). V rows n .. n+15 of a short chunk are zeroed (P is 0 there,
            // but stale shared memory could hold NaN bit patterns). Which threads copy: a copy's issue is a loop over
            // the warp's active lanes in SASS (one elected UBLKCP per lane, ~41 cycles each), so a warp's copies go
            // out one after another (threads 0..255 in order gave warps 0..7 32 copies each, ~1870 cycles per chunk:
            // a helper's SASS audit, session 26). MK_ATTN_ISSUE=1: the two-warp variant spreads them over 16 lanes
            // of every warp (half the time); in the one-warp variant the warps AWARPS.. that do not compute issue
            // them (ISSUE_IDLE) while the others go on to their wait and math. 0: threads 0..255.
            unsigned long long* bar = &s_abar[stage];
            constexpr int first = ISSUE_IDLE ? AWARPS * 32 : 0;   // the first issuing thread
            if (threadIdx.x == first) mbar_expect_tx(bar, (unsigned)(2 * n * d * 2));
            const auto copy_row = [&](int i) {     // row i of the chunk's 2n: K rows, then V rows
                const bool v = i >= n;
                const int r = v ? i - n : i;
                const bf16* src = key_row(t0 + r) + (v ? (size_t)bs * KVs : 0);
                bulk_load((v ? sV : sK) + (size_t)(stage * CH + r) * rowp, src, (unsigned)d * 2, bar,
                          l2_evict_first());
            };
            if constexpr (!MK_ATTN_ISSUE) {
                fence_proxy_async();
                for (int i = threadIdx.x; i < 2 * n; i += NT) copy_row(i);
            } else {
                static_assert(2 * CH <= (NW - AWARPS) * 32 && 2 * CH <= NW * 16, "one copy per issuing lane");
                // ISSUE_IDLE: threads first.. in order (NT - first >= 2n); else lanes 0..15 of every warp
                const int i = ISSUE_IDLE ? (int)threadIdx.x - first : (lane < 16 ? warp * 16 + lane : NT);
                if (i >= 0 && i < 2 * n) {
                    fence_proxy_async();           // (the stage's last reads, another thread's, were before a barrier)
                    copy_row(i);
                }
            }
            constexpr int per = d >> 3;
            const int pad = min(CH, (n + 15) / 16 * 16) - n;
            for (int u = threadIdx.x; u < pad * per; u += NT) {
                const int r = n + u / per, c = u % per;
                *reinterpret_cast<uint4*>(sV + (size_t)(stage * CH + r) * rowp + c * 8) = make_uint4(0, 0, 0, 0);
            }
        } else {
            // 16-byte cp.async, one KV block segment at a time; V rows n .. n+15 of a short chunk zeroed (as above)
            constexpr int per = d >> 3;
            for (int t = 0; t < n;) {
                const int ts = t0 + t, len = min(n - t, bs - ts % bs);
                const bf16* kb = tab_smem ? key_row(ts) : kv_slot(P, grp, lig, s, ts) + kvh * d;
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
            cp_async_commit();                 // every thread commits: the group counts stay uniform
        }
    };
    auto wait_chunk = [&](int c) {             // every thread: chunk c's copies landed (bulk paths)
        const int st = c % nst;
        mbar_wait(&s_abar[st], (ph >> st) & 1u);
        ph ^= 1u << st;
    };
    int t_issue = a0, n_issued = 0;            // the next chunk to load, and how many were issued
    auto issue_next = [&]() {
        const int n = chunk_len(t_issue);
        load_chunk(t_issue, n, n_issued % nst);
        t_issue += n;
        n_issued++;
    };
    // Keys before this step's position were written by earlier launches: load them before waiting (a TM chunk's
    // masked rows past k1 may be this step's; their values are never used).
    while (n_issued < nst - 1 && t_issue < k1 && t_issue + chunk_len(t_issue) <= p) issue_next();
    const bool pre = n_issued > 0;
    if (pre) prof_mark(PS_ISSUED);
    if (!wait_rec(P, rec, ticket)) {           // no copy may outlive the task: wait for the ones issued
        if constexpr (BULK) {
            for (int c2 = 0; c2 < n_issued; c2++) wait_chunk(c2);
            if (threadIdx.x == 0) s_aphase = ph;
        } else {
            cp_async_wait_all();
        }
        return false;
    }
    // this step's own keys (position p) were written by the QKV tiles' generic stores: order them (acquired by the
    // wait) before the bulk copies' async-proxy reads
    if constexpr (BULK) fence_proxy_async_global();
    while (n_issued < nst - 1 && t_issue < k1) issue_next();
    if (!pre) prof_mark(PS_ISSUED);
    // Q of the kv head's query heads, bf16 [gq][d], after the ring: row g of the MMA's A operand
    const bf16* qg = PP(const bf16*, q) + ((size_t)l * Bm + s) * Q + (size_t)kvh * gq * d;
    // (MK_ATTN_Q_ASYNC=2: the bulk paths too, where nothing else uses cp.async: the first chunk's wait adds a
    // cp.async wait for Q's rows before the barrier that publishes them)
    constexpr bool q_async = MK_ATTN_Q_ASYNC == 2 || (MK_ATTN_Q_ASYNC && !BULK);
    [[maybe_unused]] const int n_before_q = n_issued;   // chunk groups committed before Q's (q_async)
    if constexpr (q_async) {
        // its own cp.async group, older than every chunk group after it: the loop's first wait covers it (with
        // more than two stages by counting it, below), and the loop issues its next chunk without waiting for Q's
        // round trip first (the register load's STS did)
        if constexpr (QPAD != 0) {
            for (int i = threadIdx.x; i < gq * (d / 8); i += NT) {
                const int r = i / (d / 8);
                cp_async16(sQ + (size_t)q_chunk<d, QPAD>(r, i - r * (d / 8)) * 8, qg + (size_t)i * 8);
            }
        } else {
            for (int i = threadIdx.x; i < gq * d / 8; i += NT) cp_async16(sQ + (size_t)i * 8, qg + (size_t)i * 8);
        }
        cp_async_commit();                     // every thread: the group counts stay uniform
    } else if constexpr (QPAD != 0) {
        for (int i = threadIdx.x; i < gq * (d / 2); i += NT) {
            const int r = i / (d / 2);
            reinterpret_cast<unsigned*>(sQ)[q_word<d, QPAD>(r, i - r * (d / 2))] =
                __ldcg(reinterpret_cast<const unsigned*>(qg) + i);
        }
    } else {
        for (int i = threadIdx.x; i < gq * d / 2; i += NT)
            reinterpret_cast<unsigned*>(sQ)[i] = __ldcg(reinterpret_cast<const unsigned*>(qg) + i);
    }
    float m_run = -INFINITY, l_run = 0.f;      // row g's running max (scaled scores) and this thread's partial sum
    constexpr bool FAST = MK_ATTN_MATH && !TM;  // (mk_attn_math.cuh: the restructured math, padded-row paths)
    const AttnQSmem<d, QPAD> q_smem{sQ, gq};
    // DSPLIT (head_dim a multiple of 32): two warps per 16-key slice, each accumulating half the output dims (both
    // compute the slice's scores: the same instructions on the same inputs, so the same softmax state, and the same
    // sums as one warp per slice); else one warp per slice, all dims
    constexpr bool DS = DSPLIT && KS % 2 == 0;
    constexpr int NPM = DS ? KS / 2 : KS;      // 16-dim pairs of P V per computing warp
    const int slice = DS ? warp % AWARPS : warp, half = DS ? warp / AWARPS : 0;
    const bool computes = warp < (DS ? 2 : 1) * AWARPS;
    const int np0 = half * NPM;                // this warp's first 16-dim pair
    float o[2 * NPM][2];                       // row g, dims (np0 * 2 + nt) * 8 + 2t4 (+1)
#pragma unroll
    for (int nt = 0; nt < 2 * NPM; nt++) o[nt][0] = o[nt][1] = 0.f;
    int t0 = a0, c = 0;
#if ATTN_STATS
    long long st_wait = 0, st_math = 0, st_issue = 0, t_chunk = 0, t_issued = 0;   // (thread 0's sums, MK_ATTN_STATS)
#endif
    while (t0 < k1) {
        const int n = chunk_len(t0), stage = c % nst;
        const int lo_off = TM ? max(k0 - t0, 0) : 0;   // keys of this chunk before the split (TM's first chunk)
#if ATTN_STATS
        if (threadIdx.x == 0) t_chunk = prof_now();
#endif
        // the next chunk goes into the stage chunk c - 1 used: every thread left it at the barrier ending c - 1
        if (t_issue < k1) issue_next();
#if ATTN_STATS
        if (threadIdx.x == 0) { t_issued = prof_now(); st_issue += t_issued - t_chunk; }
#endif
        if constexpr (BULK) {
            wait_chunk(c);
            if (q_async && c == 0) cp_async_wait_all();   // this thread's copies of Q's rows
        } else {
            // chunk c's group and every older one, at c == 0 Q's too (mk_attn_layout.cuh): with a ring of two the
            // chunks after c are the groups to leave, but with more (MEGAKERNEL_ATTN_MAX_STAGES=3, attn_stages=3)
            // chunk 1 is committed before Q's rows too, and leaving n_issued - 1 groups let chunk 0's math read Q
            // before its copies landed (a helper's review, session 26)
            cp_async_wait_pending(AST > 2 ? attn_pending_groups(c, n_issued, n_before_q, q_async) : n_issued - c - 1);
        }
        if constexpr (TM) {
            // rows the boxes brought that are not the split's keys, and rows of the last 16-key slice no box
            // covered: V zeroed (P is 0 there; 0 * NaN would not be)
            const int rows = lo_off > 0 || n < CH ? (n + 15) & ~15 : 0, per = NCB * 8;   // (first / last chunk)
            for (int u = threadIdx.x; u < rows * per; u += NT) {
                const int r = u / per, cc = u - r * per;
                if (r < lo_off || r >= n)
                    *reinterpret_cast<uint4*>(smem + tm_v + (size_t)stage * CH * d * 2 + tm_off<NCB>(r, cc * 8)) =
                        make_uint4(0, 0, 0, 0);
            }
        }
        if (!LAP_SYNC0 || c == 0) __syncthreads();
        if (c == 0) prof_mark(PS_LANDED);      // the first chunk of K/V is in shared memory
#if ATTN_STATS
        if (threadIdx.x == 0) { t_chunk = prof_now(); st_wait += t_chunk - t_issued; }
#endif
        const int kb = slice * 16;             // this warp's slice of the chunk
        if (computes && kb < n && kb + 16 > lo_off) {
            if constexpr (TM) {
                const AttnKVTensor<NCB> kv{smem + tm_k + (size_t)stage * CH * d * 2,
                                           (unsigned)(smem_addr(smem) + tm_v + stage * CH * d * 2)};
                attn_chunk_math<KS, NPM, false>(q_smem, kv, kb, n, lo_off, scale, np0, m_run, l_run, o);
            } else {
                const AttnKVPadded<rowp> kv{sK, sV, stage * CH};
                attn_chunk_math<KS, NPM, FAST>(q_smem, kv, kb, n, lo_off, scale, np0, m_run, l_run, o);
            }
        }
        __syncthreads();
#if ATTN_STATS
        if (threadIdx.x == 0) st_math += prof_now() - t_chunk;
#endif
        t0 += n;
        c++;
    }
    if constexpr (q_async) {
        if (c == 0) {                          // (a split without keys: no chunk wait covered Q's copies, and the
            cp_async_wait_all();               // merge below reuses the ring's shared memory)
            __syncthreads();
        }
    }
#if ATTN_STATS
    if (threadIdx.x == 0) { s_pmark[0] = st_wait; s_pmark[1] = st_math; s_pmark[2] = st_issue; s_pmark[3] = c; }
#endif
    // merge the computing warps (a warp that never had a key keeps max -inf, sum 0, output 0)
    float* sOw = reinterpret_cast<float*>(smem);
    float* sMw = sOw + AWARPS * gq * merge_pitch<d, MPAD>();
    float* sLw = sMw + AWARPS * MK_ATTN_MAX_GROUP;
    if (computes) {
        l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
        l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
        if (g < gq) {
            if (t4 == 0 && half == 0) {        // (a slice's two warps hold the same max and sum)
                sMw[slice * MK_ATTN_MAX_GROUP + g] = attn_max_natural<FAST>(m_run);
                sLw[slice * MK_ATTN_MAX_GROUP + g] = l_run;
            }
            // (mk_attn_layout.cuh's merge_float; unpadded in the form the default build has always compiled)
            float* ow = MPAD ? sOw + merge_float<d, MPAD>(slice * gq + g, np0 * 16 + 2 * t4)
                             : sOw + (size_t)(slice * gq + g) * d + np0 * 16 + 2 * t4;
#pragma unroll
            for (int nt = 0; nt < 2 * NPM; nt++)
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
            acc += sOw[MPAD ? merge_float<d, MPAD>(w * gq + h, dd) : (size_t)(w * gq + h) * d + dd] * e;
        }
        po[i] = acc / L;
        if (dd == 0) PP(float*, part_lse)[(size_t)(pbase + j) * gq + h] = M + logf(L);
    }
    if constexpr (BULK)
        if (threadIdx.x == 0) s_aphase = ph;
    task_signal(P, rec[RF_SIG]);
    return true;
}

// The instantiation of task_attn_d for KS and TM, with the two-warps-per-slice variant where ds asks for it and the
// build has it (MK_ATTN_DSPLIT=1; even KS only).
template <int KS, bool TM>
__device__ __forceinline__ bool attn_variant(const Params& P, const int* rec, int ticket, bool ds) {
    if constexpr (MK_ATTN_DSPLIT && KS % 2 == 0)
        if (ds) return task_attn_d<KS, TM, true>(P, rec, ticket);
    return task_attn_d<KS, TM, false>(P, rec, ticket);
}

__device__ bool task_attn(const Params& P, const int* rec, int ticket) {
    static_assert(MK_ATTN_MAX_HEAD_DIM == 128, "one instantiation per 16 dims up to 128");
    const bool ds = PI(attn_dsplit) != 0;
#if MK_ATTN_BULK == 2
    // the tensor-copy path where the host encoded KV maps (head_dim 64 or 128, blocks a multiple of 16 keys)
    if (PP(const void*, kv_tmaps) != nullptr) {
        if (PI(head_dim) == 128) return attn_variant<8, true>(P, rec, ticket, ds);
        if (PI(head_dim) == 64) return attn_variant<4, true>(P, rec, ticket, ds);
    }
#endif
    switch (PI(head_dim) >> 4) {           // check_supported: head_dim a multiple of 16, <= 128
        case 1: return attn_variant<1, false>(P, rec, ticket, ds);
        case 2: return attn_variant<2, false>(P, rec, ticket, ds);
        case 3: return attn_variant<3, false>(P, rec, ticket, ds);
        case 4: return attn_variant<4, false>(P, rec, ticket, ds);
        case 5: return attn_variant<5, false>(P, rec, ticket, ds);
        case 6: return attn_variant<6, false>(P, rec, ticket, ds);
        case 7: return attn_variant<7, false>(P, rec, ticket, ds);
        default: return attn_variant<8, false>(P, rec, ticket, ds);
    }
}

// ---- attention combine: merge the splits of one (sequence, kv head) ---------------------------------------------
// Per query head h of the kv head: the max and the sum of exp of the n splits' log-sum-exps lse[j * gq + h], read
// from L2 (FROM_L2) or from shared memory.
template <bool FROM_L2>
__device__ __forceinline__ void combine_stats(const float* lse, int n, int gq, float* sMx, float* sDen) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    auto at = [&](int j, int h) { return FROM_L2 ? ldcg_f(lse + (size_t)j * gq + h) : lse[j * gq + h]; };
    for (int h = warp; h < gq; h += NW) {
        float mx = -INFINITY;
        for (int j = lane; j < n; j += 32) mx = fmaxf(mx, at(j, h));
        mx = warp_max(mx);
        float den = 0.f;
        for (int j = lane; j < n; j += 32) den += expf(at(j, h) - mx);
        den = warp_sum(den);
        if (lane == 0) { sMx[h] = mx; sDen[h] = den; }
    }
}

// One round of a combine's merge: splits j0 .. j0 + U - 1 (of jn) of this thread's outputs threadIdx.x + k * NT,
// k < KN (KN * NT >= gq * d). `load` issues all U x KN loads before any is used, their addresses clamped into range
// (a split past jn re-reads split jn - 1, an output past gq * d the last one; neither is added), so no per-thread
// branch splits them: one L2 round trip per round. `accumulate` adds them to acc in split order. (Loads under
// per-thread `if`s compiled to a round trip per output group; clamping all MK_ATTN_OUT_PER_THREAD groups instead
// doubled a long context's combine traffic: SPEED_NOTES.md, sixth session.)
template <int U, int KN>
struct CombineRound {
    static_assert(KN <= MK_ATTN_OUT_PER_THREAD, "acc has MK_ATTN_OUT_PER_THREAD outputs");
    float v[KN][U];
    __device__ __forceinline__ void load(const float* po, int j0, int jn, int nout) {
#pragma unroll
        for (int k = 0; k < KN; k++) {
            const int o = min(threadIdx.x + k * NT, nout - 1);
#pragma unroll
            for (int u = 0; u < U; u++) v[k][u] = ldcg_f(po + (size_t)min(j0 + u, jn - 1) * nout + o);
        }
    }
    __device__ __forceinline__ void accumulate(const float* sWt, int j0, int jn, int gq, int d, float* acc) const {
#pragma unroll
        for (int k = 0; k < KN; k++) {
            const int h = min(threadIdx.x + k * NT, gq * d - 1) / d;
            float a = acc[k];
#pragma unroll
            for (int u = 0; u < U; u++)
                if (j0 + u < jn) a = fmaf(sWt[(j0 + u) * gq + h], v[k][u], a);
            acc[k] = a;
        }
    }
};

// acc[k] += the weighted partial outputs of splits 0..jn-1 (po and sWt start at the first of them), U per round.
template <int U, int KN>
__device__ __forceinline__ void combine_accumulate(const float* po, const float* sWt, int jn, int gq, int d,
                                                   float* acc) {
    for (int jj = 0; jj < jn; jj += U) {
        CombineRound<U, KN> r;
        r.load(po, jj, jn, gq * d);
        r.accumulate(sWt, jj, jn, gq, d, acc);
    }
}

// combine_accumulate with the fewest output groups that cover gq * d, U splits per round.
template <int U>
__device__ __forceinline__ void combine_accumulate_any(const float* po, const float* sWt, int jn, int gq, int d,
                                                       float* acc) {
    if (gq * d <= 2 * NT) combine_accumulate<U, 2>(po, sWt, jn, gq, d, acc);
    else combine_accumulate<U, MK_ATTN_OUT_PER_THREAD>(po, sWt, jn, gq, d, acc);
}

// The split weights of a combine of n <= MAXS splits into sWt [n][gq] (exp(lse - max) / sum per query head), the
// log-sum-exps read once, all in flight; marks 0 and 1 on the first pass.
__device__ __forceinline__ void combine_weights(const float* lse, int n, int gq, float* sWt, float* sMx, float* sDen,
                                                int rep) {
    for (int i = threadIdx.x; i < n * gq; i += NT) sWt[i] = ldcg_f(lse + i);
    __syncthreads();
    if (!rep) prof_phase(0);
    combine_stats<false>(sWt, n, gq, sMx, sDen);
    __syncthreads();
    for (int i = threadIdx.x; i < n * gq; i += NT) {
        const int h = i % gq;
        sWt[i] = expf(sWt[i] - sMx[h]) / sDen[h];
    }
    __syncthreads();
    if (!rep) prof_phase(1);
}


#if MK_SMALL_VEC >= 3
// A combine of n <= U splits with two outputs a thread (gq * d <= 2 * NT): its partials' loads (one round) issued
// before its log-sum-exps', so it waits for one L2 round trip instead of two; the same sums as combine_accumulate's.
template <int U>
__device__ __forceinline__ void combine_one_trip(const float* po, const float* lse, int n, int gq, int d, float* sWt,
                                                 float* sMx, float* sDen, int rep, float* acc) {
    CombineRound<U, 2> r;
    r.load(po, 0, n, gq * d);
    combine_weights(lse, n, gq, sWt, sMx, sDen, rep);
    r.accumulate(sWt, 0, n, gq, d, acc);
}
#endif

// A combine task over a part of its kv head's query heads (combine_parts > 1): outputs o0 .. o0 + nout - 1 of the
// kv head's gq * d, nout <= NT. The block's threads split into G = NT / nout groups of nout; group g sums splits
// g, g + G, g + 2G, ... (a warp reads one split's consecutive outputs), U at a time, all U loads in flight; then
// thread o < nout adds the G groups' sums in group order. sWt holds every head's split weights (combine_weights).
template <int U>
__device__ __forceinline__ float combine_part_sum(const float* po, const float* sWt, float* sPart, int n, int gq,
                                                  int d, int o0, int nout) {
    const int G = NT / nout, g = threadIdx.x / nout, o = threadIdx.x - g * nout;
    const int ko = o0 + min(o, nout - 1), h = ko / d;
    float a = 0.f;
    if (g < G) {
        for (int j0 = g; j0 < n; j0 += U * G) {
            float v[U];
#pragma unroll
            for (int u = 0; u < U; u++) v[u] = ldcg_f(po + (size_t)min(j0 + u * G, n - 1) * gq * d + ko);
#pragma unroll
            for (int u = 0; u < U; u++)
                if (j0 + u * G < n) a = fmaf(sWt[(j0 + u * G) * gq + h], v[u], a);
        }
        sPart[threadIdx.x] = a;
    }
    __syncthreads();
    float r = 0.f;
    if (threadIdx.x < nout)
        for (int gg = 0; gg < G; gg++) r += sPart[gg * nout + threadIdx.x];
    return r;
}

__device__ bool task_combine(const Params& P, const int* rec, int ticket) {
    if (!wait_rec(P, rec, ticket)) return false;
    const int parts = PI(combine_parts);
    const int l = rec[RF_LAYER], s = rec[RF_A0], kvh = rec[RF_A1] / parts, part = rec[RF_A1] - kvh * parts;
    const int n = rec[RF_A2], pbase = rec[RF_A3];
    const int d = PI(head_dim), nkv = PI(n_kv), gq = PI(n_heads) / nkv, Q = PI(n_heads) * d, Bm = PI(Bm);
    const float* lse = PP(const float*, part_lse) + (size_t)pbase * gq;
    const float* po = PP(const float*, part_o) + (size_t)pbase * gq * d;
    const int MAXS = 256;
    if (!smem_fits(P, (size_t)(2 * MK_MAX_GROUP + MAXS * gq + NT) * 4, ticket)) return false;
    float* sMx = reinterpret_cast<float*>(smem);
    float* sDen = sMx + MK_MAX_GROUP;
    float* sWt = sDen + MK_MAX_GROUP;          // [MAXS][gq]
    if (parts > 1 && n <= MAXS) {
        const int nout = gq / parts * d, o0 = part * nout;
        if (gq % parts || nout > NT) {        // (the plan refuses such parts: every output must have a thread)
            if (threadIdx.x == 0) record_error(P, MK_ERR_BAD_OPCODE, ticket);
            return false;
        }
        combine_weights(lse, n, gq, sWt, sMx, sDen, 0);
        const float r = n <= 64 ? combine_part_sum<16>(po, sWt, sWt + MAXS * gq, n, gq, d, o0, nout)
                                : combine_part_sum<32>(po, sWt, sWt + MAXS * gq, n, gq, d, o0, nout);
        prof_phase(2);
        bf16* out = PP(bf16*, attn) + ((size_t)l * Bm + s) * Q + (size_t)kvh * gq * d + o0;
        if (threadIdx.x < nout) out[threadIdx.x] = f2bf(r);
        task_signal(P, rec[RF_SIG]);
        return true;
    }
    float acc[MK_ATTN_OUT_PER_THREAD];
#pragma unroll
    for (int k = 0; k < MK_ATTN_OUT_PER_THREAD; k++) acc[k] = 0.f;
#if MK_SMALL_VEC
    if (n <= MAXS) {       // every log-sum-exp read once, all in flight; all splits' partials in one round trip
        for (int rep = 0; rep < MK_REPEAT_SMALL; rep++) {   // (> 1: the experiment of mk_common.cuh; idempotent)
            if (rep) {
                __syncthreads();
#pragma unroll
                for (int k = 0; k < MK_ATTN_OUT_PER_THREAD; k++) acc[k] = 0.f;
            }
#if MK_SMALL_VEC >= 3
            if (n <= 8 && gq * d <= 2 * NT) combine_one_trip<8>(po, lse, n, gq, d, sWt, sMx, sDen, rep, acc);
            else if (n <= 16 && gq * d <= 2 * NT) combine_one_trip<16>(po, lse, n, gq, d, sWt, sMx, sDen, rep, acc);
            else
#endif
            {
                combine_weights(lse, n, gq, sWt, sMx, sDen, rep);
                if (n <= 8) combine_accumulate_any<8>(po, sWt, n, gq, d, acc);
                else combine_accumulate_any<16>(po, sWt, n, gq, d, acc);
            }
            prof_phase(rep ? 3 : 2);         // (thread 0's share of the merge: the others may still run)
        }
    } else
#endif
    {
        combine_stats<true>(lse, n, gq, sMx, sDen);
        __syncthreads();
        for (int j0 = 0; j0 < n; j0 += MAXS) {
            const int jn = min(MAXS, n - j0);
            for (int i = threadIdx.x; i < jn * gq; i += NT) {
                const int h = i % gq;
                sWt[i] = expf(ldcg_f(lse + (size_t)j0 * gq + i) - sMx[h]) / sDen[h];
            }
            __syncthreads();
            combine_accumulate_any<8>(po + (size_t)j0 * gq * d, sWt, jn, gq, d, acc);
            __syncthreads();
        }
        prof_phase(2);
    }
    bf16* out = PP(bf16*, attn) + ((size_t)l * Bm + s) * Q + (size_t)kvh * gq * d;
#pragma unroll
    for (int k = 0; k < MK_ATTN_OUT_PER_THREAD; k++) {
        const int o = threadIdx.x + k * NT;
        if (o < gq * d) out[o] = f2bf(acc[k]);
    }
    task_signal(P, rec[RF_SIG]);
    return true;
}
