// The decode megakernel: one persistent launch runs every task of a decode step (see schedule.py for the task
// list and the no-deadlock argument, opcodes.py for the record layout). One block per SM; blocks claim tasks
// with one global ticket in list order; a task waits only on the counters of the tasks whose output it reads.
// The task kinds live in one header each (by role); this file is the persistent loop and the host entry points.
#include <cstring>
#include <mutex>
#include <vector>
#include "mk_tmap.h"
#include "mk_common.cuh"
#include "mk_gemv.cuh"
#include "mk_lm_head.cuh"
#include "mk_norm.cuh"
#include "mk_attention.cuh"
#include "mk_routing.cuh"
#include "mk_moe.cuh"
#include "mk_peak.cuh"      // (a kernel of its own: the bench's bulk-copy read peak)

// ---- the persistent kernel ---------------------------------------------------------------------------------------
// (MK_BLOCKS_PER_SM resident blocks per SM: the register cap that lets them all fit, 128 registers either way)
extern "C" __global__ void __launch_bounds__(NT, MK_BLOCKS_PER_SM) mk_decode(const __grid_constant__ Params P) {
    __shared__ int s_rec[MK_REC_INTS];
    __shared__ int s_abort;
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
    if (threadIdx.x == 0) {
        s_next = atomicAdd(ctrl + CTRL_TICKET, 1);
        s_pf_ticket = -1;
        s_pf_buf = 0;
        init_weight_buffers();
        init_attention_ring();
    }
    __syncthreads();
    while (true) {
        __syncthreads();                      // (claim_ahead == 0: thread 0 claimed s_next at its last task's signal)
        const int ticket = s_next;
        __syncthreads();
        if (ticket >= n_tasks) break;
#if MK_EARLY_TABLES
        // every load first, then the stores: one round trip (below, thread 0's abort-flag store waits for its load
        // before its warp's other lanes issue their record loads: two)
        const int rv = threadIdx.x < MK_REC_INTS ? __ldg(tasks + (size_t)ticket * MK_REC_INTS + threadIdx.x) : 0;
        int ab = 0, nx = 0;
        if (threadIdx.x == 0) {
            ab = ld_volatile(ctrl + CTRL_ABORT);
            if (PI(claim_ahead)) nx = atomicAdd(ctrl + CTRL_TICKET, 1);   // (as below)
        }
        if (threadIdx.x < MK_REC_INTS) s_rec[threadIdx.x] = rv;
        if (threadIdx.x == 0) {
            s_abort = ab;
            if (PI(claim_ahead)) s_next = nx;
        }
#else
        if (threadIdx.x == 0) {
            s_abort = ld_volatile(ctrl + CTRL_ABORT);
            // claim the next ticket early (see schedule.py), or (claim_ahead == 0) at this task's signal
            // (task_signal): a ticket claimed early waits for this task's own dependency wait, however long, while
            // a free block could have run it
            if (PI(claim_ahead)) s_next = atomicAdd(ctrl + CTRL_TICKET, 1);
        }
        if (threadIdx.x < MK_REC_INTS) s_rec[threadIdx.x] = __ldg(tasks + (size_t)ticket * MK_REC_INTS + threadIdx.x);
#endif
        // this task's weights, if the previous task issued them (read before the barrier: this task's thread 0 may
        // record the next prefetch)
        const int pf_buf = s_pf_ticket == ticket ? s_pf_buf : -1;
        __syncthreads();
        if (s_abort) break;
        prof_reset();
        const int op = s_rec[RF_OP];
        // the small task kinds use less shared memory than the scratch and weight buffer 0 (the plan checks):
        // they prefetch the next GEMV tile into buffer 1 before their own wait
        if (op == OP_NORM || op == OP_TOPK || op == OP_ATTN_COMBINE) prefetch_next(P, 1);
        bool ok;
        switch (op) {
            case OP_NORM: ok = task_norm(P, s_rec, ticket); break;
            case OP_QKV:
            case OP_OPROJ:
            case OP_ROUTER:
            case OP_MLP_GU:
            case OP_MLP_DOWN: ok = task_gemv(P, s_rec, ticket, pf_buf); break;
            case OP_LM_HEAD:
                ok = s_rec[RF_A3] > 0 ? task_lm_stream(P, s_rec, ticket) : task_gemv(P, s_rec, ticket, pf_buf);
                break;
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
    drain_weights();                         // an aborted step may leave a prefetch in flight
#if MK_PROFILE
    if (threadIdx.x == 0) {
        pblock[PB_G_END] = pblock[PB_C_END] = prof_now();
    }
#endif
    if (threadIdx.x == 0) atomicAdd(ctrl + CTRL_DONE_BLOCKS, 1);
}

// ---- host entry points (ctypes) ------------------------------------------------------------------------------------
extern "C" int mk_num_params() { return MK_NUM_PARAMS; }
// the paged worker's item slots this library was built with (the plan must lay out as many: backend.check_page_layout)
extern "C" int mk_page_slots() { return MK_PAGE_SLOTS; }
// and its ring pages' bytes (MK_PAGE_BYTES: the plan's ring layout must use the same)
extern "C" int mk_page_bytes() { return MK_PAGE_BYTES; }
// and its computing warps per ring page (MK_PG_PAGE_WARPS: the plan's ring holds at most NUM_WARPS - 2 of them)
extern "C" int mk_page_warps() { return MK_PG_PAGE_WARPS; }

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

// The device current and mk_decode allowed `smem_bytes` of dynamic shared memory (both entry points below need it).
static cudaError_t select_and_size(int device, int smem_bytes) {
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return e;
    return cudaFuncSetAttribute(mk_decode, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
}

// Blocks of mk_decode that can be resident on one SM with `smem_bytes` of dynamic shared memory (into *blocks): the
// backend launches MK_BLOCKS_PER_SM x SMs blocks and refuses a launch they would not all fit (schedule.py's
// no-deadlock argument needs every block resident). 0 on success, else a cudaError_t.
extern "C" int mk_occupancy(int device, int smem_bytes, int* blocks) {
    const cudaError_t e = select_and_size(device, smem_bytes);
    if (e != cudaSuccess) return (int)e;
    return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, mk_decode, NT, (size_t)smem_bytes);
}

// Attention's K/V tensor map of one KV group's pool: rows of row_elems (every kv head's K or V of one token), boxes
// of box_rows tokens x col_blocks 64-column blocks (128 bytes into out; csrc/mk_tmap.h mk_tmap_encode_swizzled_3d).
extern "C" int mk_encode_kv(void* out, const void* base, unsigned long long rows, int row_elems, int box_rows,
                            int col_blocks) {
    CUtensorMap map;
    const int rc = mk_tmap_encode_swizzled_3d(&map, base, rows, row_elems, box_rows, col_blocks);
    if (rc == 0) memcpy(out, &map, sizeof(map));
    return rc;
}

// The parameters' trip to __constant__ memory (mk_common.cuh c_params), per device. Each launch's copy comes from a pinned
// host slot, so it is truly asynchronous (a copy from pageable memory may wait for the stream); a slot is reused
// only once the copy that read it has run (its event), and when the next slot's copy has not run yet (more launches
// in flight than slots) the ring grows instead of waiting, so the host does not wait for the GPU here (the pinned
// allocations, at the first launch and when the ring grows, are the calls that may). Every copy, and
// the control block's reset, waits for the previous launch on the device whatever its stream (`launched`): a launch
// must not see its constants or counters change under it. One lock: launches from several threads stay whole.
struct ParamSlot {
    long long* host = nullptr;                   // MK_NUM_PARAMS values, pinned
    cudaEvent_t copied = nullptr;                // recorded after the copy that read them
};
struct ParamRing {
    std::vector<ParamSlot> slots;
    cudaEvent_t launched = nullptr;              // recorded after the last launch (or its copy, if it failed)
    size_t next = 0;
    long long tables_version = -1;               // (MK_CONST_TABLES) the tables now in constant memory
};
#define MK_PARAM_DEVICES 64              // devices a process may launch on (their rings)
#define MK_PARAM_SLOTS 16                // pinned slots per ring at its first launch
static ParamRing g_param_ring[MK_PARAM_DEVICES];
static std::mutex g_launch_lock;

static cudaError_t new_param_slot(ParamSlot& s) {
    cudaError_t e = cudaHostAlloc(reinterpret_cast<void**>(&s.host), sizeof(long long) * MK_NUM_PARAMS,
                                  cudaHostAllocDefault);
    if (e != cudaSuccess) { s.host = nullptr; return e; }
    e = cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming);
    if (e != cudaSuccess) { cudaFreeHost(s.host); s.host = nullptr; s.copied = nullptr; }
    return e;
}

// A slot whose previous copy has run (a new one where the next has not), filled with `params`.
static cudaError_t take_param_slot(ParamRing& r, const long long* params, ParamSlot** out) {
    if (r.launched == nullptr) {
        cudaError_t e = cudaEventCreateWithFlags(&r.launched, cudaEventDisableTiming);
        if (e != cudaSuccess) { r.launched = nullptr; return e; }
        // MK_PARAM_SLOTS up front: a page-locked allocation may serialise the device's streams, so the ring grows
        // only past that many launches in flight (the engine keeps one step of one launch per 16 rows in flight)
        for (int i = 0; i < MK_PARAM_SLOTS && e == cudaSuccess; i++) {
            ParamSlot slot;
            e = new_param_slot(slot);
            if (e == cudaSuccess) r.slots.push_back(slot);
        }
        if (e != cudaSuccess) return e;
    }
    bool busy = false;
    if (!r.slots.empty() && cudaEventQuery(r.slots[r.next % r.slots.size()].copied) == cudaErrorNotReady) {
        busy = true;
        (void)cudaGetLastError();                // (not an error: not to be reported by a later check)
    }
    if (r.slots.empty() || busy) {
        ParamSlot s;
        const cudaError_t e = new_param_slot(s);
        if (e != cudaSuccess) return e;
        r.next = r.slots.empty() ? 0 : r.next % r.slots.size();
        r.slots.insert(r.slots.begin() + (long)r.next, s);
    }
    ParamSlot& s = r.slots[r.next % r.slots.size()];
    r.next++;
    memcpy(s.host, params, sizeof(long long) * MK_NUM_PARAMS);
    *out = &s;
    return cudaSuccess;
}

// Zeroes the control block and counters, then launches the step, all on `stream`.
extern "C" int mk_launch(int device, const long long* params, int grid, int smem_bytes, void* sync_ptr,
                         long long sync_bytes, void* stream) {
    cudaError_t e = select_and_size(device, smem_bytes);
    if (e != cudaSuccess) return (int)e;
    Params P;
    for (int i = 0; i < MK_NUM_PARAMS; i++) P.v[i] = params[i];
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    if (device < 0 || device >= MK_PARAM_DEVICES) return (int)cudaErrorInvalidDevice;
    std::lock_guard<std::mutex> guard(g_launch_lock);
    ParamRing& ring = g_param_ring[device];
    ParamSlot* slot = nullptr;
    e = take_param_slot(ring, params, &slot);
    if (e != cudaSuccess) return (int)e;
    e = cudaStreamWaitEvent(st, ring.launched, 0);   // (never recorded yet: no wait)
    if (e != cudaSuccess) return (int)e;
    e = cudaMemsetAsync(sync_ptr, 0, (size_t)sync_bytes, st);
    if (e != cudaSuccess) return (int)e;
    e = cudaMemcpyToSymbolAsync(c_params, slot->host, sizeof(long long) * MK_NUM_PARAMS, 0, cudaMemcpyHostToDevice,
                                st);
    if (e != cudaSuccess) return (int)e;
#if MK_CONST_TABLES
    // the backend's per-layer tables, device to device, when they are not the ones already there (a version per
    // backend's tables: an address alone could be a freed table's, reused)
    if (params[PRM_tables_version] != ring.tables_version) {
        const long long L = params[PRM_L];
        if (L < 0 || L > MK_MAX_TABLE_LAYERS) return (int)cudaErrorInvalidValue;
        e = cudaMemcpyToSymbolAsync(c_layer_info, reinterpret_cast<const void*>(params[PRM_layer_info]),
                                    sizeof(int) * MK_LAYER_INFO_INTS * L, 0, cudaMemcpyDeviceToDevice, st);
        if (e == cudaSuccess)
            e = cudaMemcpyToSymbolAsync(c_wptrs, reinterpret_cast<const void*>(params[PRM_wptrs]),
                                        sizeof(long long) * MK_WPTR_INTS * L, 0, cudaMemcpyDeviceToDevice, st);
        if (e != cudaSuccess) { ring.tables_version = -1; return (int)e; }
        ring.tables_version = params[PRM_tables_version];
    }
#endif
    e = cudaEventRecord(slot->copied, st);
    if (e != cudaSuccess) return (int)e;
    mk_decode<<<grid, NT, smem_bytes, st>>>(P);
    e = cudaGetLastError();
    const cudaError_t r = cudaEventRecord(ring.launched, st);   // (after the launch, or after its copy if it failed)
    if (e == cudaSuccess) e = r;
    return (int)e;
}
