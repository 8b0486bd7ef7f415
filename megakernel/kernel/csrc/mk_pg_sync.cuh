// The paged MoE worker's shared state (PgState, in the plan's dynamic shared memory) and its waits: the bounded
// mbarrier wait every role uses (pg_wait), its stall reports, and the loader's polling of ring pages
// (MK_PG_MULTI_ISSUE, MK_PG_ANY_SLOT). The protocol they serve is described in mk_moe_pages.cuh.
#pragma once
#include "mk_common.cuh"
#include "mk_pg_switches.cuh"

// The worker's barriers and bookkeeping: in the plan's dynamic shared memory (at pg_state_off, PAGE_STATE_BYTES of
// opcodes.py), so plans without the paged worker do not pay for them in every block's static shared memory. Set up at
// each call, invalidated before the call returns (other task kinds reuse the memory between layers).
struct PgState {
#if MK_STALL_PRINT
    int canary[4];                             // (MK_STALL_PRINT) written at set-up, printed with a stall: whether the
                                               // barriers' memory was overwritten, or only their state is wrong
#endif
    unsigned long long full[MK_PAGE_MAX];      // a page landed (tx) or an end marker
    unsigned long long empty[MK_PAGE_MAX];     // its warp is done reading it (an end marker's too)
    unsigned long long desc[MK_PAGE_SLOTS];    // an item's description is written (the loader)
    unsigned long long inp[MK_PAGE_SLOTS];     // its input rows are loaded (the input warp, every lane)
    unsigned long long outs[MK_PAGE_SLOTS];    // its pages are computed (count PAGE_OUT_ARRIVALS: the 32 lanes of
                                               // each page's warp, the rest by the loader when it publishes the item)
    unsigned long long free_[MK_PAGE_SLOTS];   // an item's epilogue is written
    long long stamp[MK_PAGE_SLOTS][5];         // (MK_PROFILE) claim, issued, waited, landed, computed (per item)
#if PG_STATS
    unsigned long long pstat[MK_PAGE_SLOTS][4];   // (MK_PG_PAGE_STATS) the item's page sums (ns), its marks
    long long pissue[MK_PAGE_MAX];             // when the ring page's current copy was issued
#endif
    int page[MK_PAGE_MAX][2];                  // item slot (-1: end marker), first row | rows << 16
    int item[MK_PAGE_SLOTS][12];               // sequence j, kind, expert slot, expert, first pair, r0, nr, K, pages,
                                               // rows in half 0, queue item, input rows
    float w[MK_PAGE_SLOTS][MB];                // a down item's pairs' routing weights
    int rank[MK_PAGE_SLOTS][MB];               // and their ranks among their rows' experts
    int done[MK_PAGE_SLOTS];                   // pages of the slot's item counted (atomics: elects the epilogue's warp)
    int stop;                                  // a wait failed (aborted step): every warp leaves
    int issued;                                // pages (and end markers) the loader issued
#if MK_PG_MULTI_ISSUE || MK_PG_ANY_SLOT
    int seq[MK_PAGE_MAX];                      // the ring page's last issued sequence number (-1: none; ANY_SLOT: its
                                               // lap count, written once the loader is done)
#endif
    const bf16* o_bias;                        // the layer's O-projection bias or null (the loader writes it before
                                               // its first item: O epilogues read no table after their wait)
};
static_assert(sizeof(PgState) <= MK_PAGE_STATE_BYTES, "opcodes.PAGE_STATE_BYTES is too small for PgState");

__device__ __forceinline__ PgState& pg_state(const Params& P) {
    return *reinterpret_cast<PgState*>(smem + PI(pg_state_off));
}
__device__ __forceinline__ int pg_ld(const int& v) { return ld_volatile(&v); }

#if MK_PROFILE
// Lane 0 of the warp that wrote item slot q's epilogue: the item's profiling record (PF_* layout, as prof_record),
// its stamps from the slot (claim: the loader decoded it; issued: its first page's copy; waited: its input row
// loaded; landed: its first page's math began; computed: its last page's math ended; end: now).
__device__ __forceinline__ void pg_prof_item(const Params& P, PgState& G, int l, int m, int q) {
    const int* it = G.item[q];
    const int kind = it[1], item = it[10];
    long long* r = PP(long long*, prof_items) + ((size_t)m * PI(prof_items_per_layer) + item) * MK_PROF_INTS;
    r[PF_BLOCK] = blockIdx.x; r[PF_SM] = smid();
    r[PF_OP] = kind == 0 ? MK_PROF_ITEM_GU : kind == 1 ? MK_PROF_ITEM_DN : MK_PROF_ITEM_O;
    r[PF_LAYER] = l;
    r[PF_ARG] = kind == 2 ? (long long)item : ((long long)it[3] << 16) | item;
    const long long* st = G.stamp[q];
    r[PF_CLAIM] = st[0]; r[PF_ISSUED] = st[1]; r[PF_WAITED] = st[2];
    r[PF_LANDED] = st[3] > st[2] ? st[3] : st[2]; r[PF_COMPUTED] = st[4] > r[PF_LANDED] ? st[4] : r[PF_LANDED];
    r[PF_END] = prof_now();
#if PG_STATS
    for (int k = 0; k < MK_PROF_N_MARKS; k++) r[PF_M0 + k] = k < 4 ? (long long)G.pstat[q][k] : -1;
#else
    for (int k = 0; k < MK_PROF_N_MARKS; k++) r[PF_M0 + k] = -1;
#endif
}
#endif

enum { PG_GU = 0, PG_DN = 1, PG_O = 2 };

// (MK_PROFILE) mark k of the worker's task record (opcodes.PROF_MARKS["MOE_WORKER"]), stamped by whichever thread
// gets there: where a worker's time goes before its first item and after its closing barrier.
__device__ __forceinline__ void pg_mark(int k) {
#if MK_PROFILE
    s_pmark[k] = prof_now();
#endif
}

#if MK_STALL_PRINT
// (MK_STALL_PRINT) a paged wait left: why (0: the worker stopped, 1: the step was aborted, 2: this wait's watchdog).
// Not inlined, as pg_stall_report.
__device__ __noinline__ void pg_spin_report(int ticket, int what, int seq, int why) {
    printf("mk stall: block %d task %d warp %d left paged wait %d (sequence %d): %s\n", blockIdx.x, ticket,
           (int)(threadIdx.x >> 5), what, seq, why == 0 ? "the worker stopped" : why == 1 ? "abort" : "watchdog");
}
#endif

#if MK_STALL_PRINT
// (MK_STALL_PRINT) an aborted worker's closing drain: whether page i's last phase (sequence s) was complete at the
// drain's first try, and the barrier's raw word then.
__device__ __noinline__ void pg_drain_report(PgState& G, int i, int s, bool done) {
    printf("mk stall:   block %d drain page %d sequence %d: %s at the first try, full %016llx\n", blockIdx.x, i, s,
           done ? "complete" : "not complete", *(volatile unsigned long long*)&G.full[i]);
}
#endif

// Lane 0 of a spinning warp: whether to leave its spin. Every wait in the worker is on another warp of this block or
// on a copy, so a protocol bug would spin forever where a counter wait times out: every 1024 asks the spin also reads
// the step's abort flag (another block's watchdog) and its clock, and past the watchdog it records ERR_STALL (which
// wait: STALL_*, and its sequence number) and aborts the step, so the host reports the stall instead of waiting on a
// kernel that never ends. G.stop (set here or by a failed counter wait) makes every role leave.
struct PgSpin {
    unsigned long long t0 = 0;
    unsigned n = 0;
    __device__ __forceinline__ bool leave(const Params& P, PgState& G, int ticket, int what, int seq) {
        if (pg_ld(G.stop)) {
#if MK_STALL_PRINT
            pg_spin_report(ticket, what, seq, 0);
#endif
            return true;
        }
        if ((++n & 1023u) != 0) return false;
        if (ld_volatile(PP(const int*, ctrl) + CTRL_ABORT)) {
#if MK_STALL_PRINT
            pg_spin_report(ticket, what, seq, 1);
#endif
            ((volatile int*)&G.stop)[0] = 1;
            return true;
        }
        const unsigned long long now = globaltimer();
        if (t0 == 0) {
            t0 = now;
        } else if (now - t0 > (unsigned long long)PL(watchdog_ns)) {
#if MK_STALL_PRINT
            pg_spin_report(ticket, what, seq, 2);
#endif
            record_error(P, MK_ERR_STALL, ticket, -1, what, seq);
            ((volatile int*)&G.stop)[0] = 1;
            return true;
        }
        return false;
    }
};

#if MK_STALL_PRINT
// Lane 0 of a warp that left a paged wait (MK_STALL_PRINT): the barrier's raw word (its phase bit and counts), the
// loader's end count (G.issued: set once its end markers are out), the canary and, for a ring page's wait (the
// sequence number then maps to the page), both its barriers and its entry. Not inlined: the printf's arguments stay
// out of the waits' registers.
__device__ __noinline__ void pg_stall_report(const Params& P, PgState& G, unsigned long long* bar, unsigned parity,
                                             int what, int seq) {
    const int* before = reinterpret_cast<const int*>(&G) - 2;   // (the 8 bytes before PgState: the x buffer's end,
                                                                 // or the outputs' or padding under pg_x_item)
    printf("mk stall:   block %d warp %d wait %d sequence %d parity %u: barrier %016llx, issued %d; canary %08x "
           "%08x, before %08x %08x, state at %d\n", blockIdx.x, (int)(threadIdx.x >> 5), what, seq, parity,
           *(volatile unsigned long long*)bar, pg_ld(G.issued), (unsigned)pg_ld(G.canary[0]),
           (unsigned)pg_ld(G.canary[3]), (unsigned)pg_ld(before[0]), (unsigned)pg_ld(before[1]), PI(pg_state_off));
    if (what == STALL_PAGE || what == STALL_EMPTY) {   // (a ring page's wait: its sequence number names the page)
        const int sl = seq % PI(pg_n);
        printf("mk stall:   block %d warp %d page %d: full %016llx empty %016llx entry %d %08x\n", blockIdx.x,
               (int)(threadIdx.x >> 5), sl, *(volatile unsigned long long*)&G.full[sl],
               *(volatile unsigned long long*)&G.empty[sl], pg_ld(G.page[sl][0]), (unsigned)pg_ld(G.page[sl][1]));
    }
}
#endif

// One warp, uniformly: lane 0 waits for the phase of `parity` (or an abort), then every lane observes it (at once:
// the phase cannot move on before this warp acts). Lanes must not leave a wait at different times: the warp's later
// shuffles need every lane at the same instruction.
__device__ __forceinline__ bool pg_wait(const Params& P, PgState& G, int ticket, unsigned long long* bar,
                                        unsigned parity, int what, int seq) {
    int ok = 1;
    if ((threadIdx.x & 31) == 0) {
        PgSpin spin;
        while (!mbar_try_wait(bar, parity))
            if (spin.leave(P, G, ticket, what, seq)) { ok = 0; break; }
#if MK_STALL_PRINT
        if (!ok) pg_stall_report(P, G, bar, parity, what, seq);
#endif
    }
    ok = __shfl_sync(0xffffffffu, ok, 0);
    if (ok) mbar_wait(bar, parity);
    return ok != 0;
}
// MK_PG_POLL_CHECK (MK_PG_MULTI_ISSUE and MK_PG_ANY_SLOT builds): a polling lane asks PgSpin whether to leave only
// every this-many-th failed poll (so the abort flag and the watchdog are read every MK_PG_POLL_CHECK * 1024 polls
// there, ~1 ms, against a watchdog of seconds). Each ask reads G.stop from shared memory beside the lanes' test_wait,
// which never suspends (unlike pg_wait's try_wait). On the H100 (speed_20261207s38 call 1, each build in its own
// process, twice) 32 against 1: b1 8K 3.325 / 3.322 against 3.352 / 3.348 ms, 1K 3.169 / 3.169 against 3.199 / 3.188
// (-0.6 to -0.9%), b8 and b16 even: a part of MULTI_ISSUE's one-row loss there (the default build: 3.286 / 3.277,
// 3.095 / 3.090).
#ifndef MK_PG_POLL_CHECK
#define MK_PG_POLL_CHECK 32
#endif
static_assert(MK_PG_POLL_CHECK >= 1 && (MK_PG_POLL_CHECK & (MK_PG_POLL_CHECK - 1)) == 0,
              "MK_PG_POLL_CHECK: a power of two");
// MK_PG_POLL_SUSPEND (pg_poll_own: MK_PG_MULTI_ISSUE's rounds, and MK_PG_ANY_SLOT's end markers): after a sweep of the
// polling lanes in which no ring page was free, the lowest lane still waiting suspends in try_wait on its page (ring
// pages free roughly in sequence order, so it is usually the next to free; the warp waits with it, up to the hardware's
// suspend limit, which also stretches the time between MK_PG_POLL_CHECK's asks) before the next sweep (1); or the lanes
// sweep with test_wait without pause (0). Tried because in the H100's page stats (speed_20261207s38 call 1, b1 8K) the
// computing warps' math per down item grew from 13.2 to 17.4 us (median page sum) under MULTI_ISSUE's busy sweeps.
// Measured on the H100 (call 2, each build in its own process, twice): b1 8K 3.367 / 3.361 against 3.325 / 3.322 ms
// without it, 1K 3.206 / 3.208 against 3.175 / 3.180 (+0.9 to +1.3%), b8 and b16 even; the math sums barely moved (down
// items 16.7 against 17.4 us, O items 31.0 against 29.9, page sums; the default's 13.2 and 24.4), so the sweeps were
// not what slowed the math (a hypothesis: more pages land together, so more warps compute at once). 0.
#ifndef MK_PG_POLL_SUSPEND
#define MK_PG_POLL_SUSPEND 0
#endif
#if MK_PG_MULTI_ISSUE || MK_PG_ANY_SLOT
// The loader warp, uniformly: each lane with `mine` polls its own ring page's `empty` phase `par` (at `bar`;
// `first_lap`: the page's first lap, which waits on nothing) with test_wait (non-blocking, so a lane whose page is
// free goes on at once) and runs act() on it; the warp loops until every such lane has (MK_PG_POLL_SUSPEND: a sweep
// that freed nothing suspends on the lowest waiting lane's page). False (every lane) if a lane's spin gave up (`seq`:
// its stall record). MULTI_ISSUE's rounds (pg_poll_lanes) and ANY_SLOT's end markers.
template <class Act>
__device__ __forceinline__ bool pg_poll_own(const Params& P, PgState& G, int ticket, bool mine, bool first_lap,
                                            unsigned long long* bar, unsigned par, int seq, Act&& act) {
    bool failed = false;
    PgSpin spin;
    unsigned polls = 0;
    while (__any_sync(0xffffffffu, mine)) {
        [[maybe_unused]] bool issued = false;   // (read under MK_PG_POLL_SUSPEND only)
        if (mine) {
            if (first_lap || mbar_test_wait(bar, par)) {
                act();
                mine = false;
                issued = true;
            } else if ((++polls & (MK_PG_POLL_CHECK - 1)) == 0 && spin.leave(P, G, ticket, STALL_EMPTY, seq)) {
                failed = true;
                mine = false;
            }
        }
#if MK_PG_POLL_SUSPEND
        const unsigned waiting = __ballot_sync(0xffffffffu, mine);
        // (the try_wait's result is not used: the next sweep's test_wait acts on it, and a lane that gives up does so
        // there, after at most the hardware's suspend limit)
        if (!__any_sync(0xffffffffu, issued) && waiting && (threadIdx.x & 31) == __ffs(waiting) - 1)
            (void)mbar_try_wait(bar, par);
#endif
    }
    return !__any_sync(0xffffffffu, failed);
}
#endif
#if MK_PG_MULTI_ISSUE
// MULTI_ISSUE's round: lane i < n takes sequence number s0 + i (n <= npg: distinct ring pages) and runs act(sq) once
// that ring page's previous lap is free.
template <class Act>
__device__ __forceinline__ bool pg_poll_lanes(const Params& P, PgState& G, int ticket, int s0, int n, int npg,
                                              Act&& act) {
    const int sq = s0 + (threadIdx.x & 31);
    return pg_poll_own(P, G, ticket, (threadIdx.x & 31) < n, sq < npg, &G.empty[sq % npg], ((sq / npg) - 1) & 1, sq,
                       [&] { act(sq); });
}
#endif
#if MK_PG_ANY_SLOT
// The loader warp, uniformly (MK_PG_ANY_SLOT): the lowest ring page free now into `slot`. Lane i < npg tests ring page
// i's last lap (`lap`: its issues so far; the first lap waits on nothing) with test_wait, which never suspends, so the
// sweep sees every page that frees; lane 0 asks PgSpin every MK_PG_POLL_CHECK-th empty sweep. False (every lane) if
// the spin gave up (`seq`: the page's sequence number, for the stall record).
__device__ __forceinline__ bool pg_any_free(const Params& P, PgState& G, int ticket, int npg, int lap, int seq,
                                            int& slot) {
    const int lane = threadIdx.x & 31;
    PgSpin spin;
    unsigned polls = 0;
    while (true) {
        const bool fr = lane < npg && (lap == 0 || mbar_test_wait(&G.empty[lane], (unsigned)(lap - 1) & 1u));
        const unsigned m = __ballot_sync(0xffffffffu, fr);
        if (m) {
            slot = __ffs(m) - 1;
            return true;
        }
        int leave = 0;
        if (lane == 0 && (++polls & (MK_PG_POLL_CHECK - 1)) == 0) leave = spin.leave(P, G, ticket, STALL_EMPTY, seq);
        if (__shfl_sync(0xffffffffu, leave, 0)) return false;
    }
}
#endif
