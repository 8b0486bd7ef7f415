// The decode megakernel: one persistent launch runs every task of a decode step (see schedule.py for the task
// list and the no-deadlock argument, opcodes.py for the record layout). One block per SM; blocks claim tasks
// with one global ticket in list order; a task waits only on the counters of the tasks whose output it reads.
// The task kinds live in one header each (by role); this file is the persistent loop and the host entry points.
#include "mk_tmap.h"
#include "mk_common.cuh"
#include "mk_gemv.cuh"
#include "mk_lm_head.cuh"
#include "mk_norm.cuh"
#include "mk_attention.cuh"
#include "mk_routing.cuh"
#include "mk_moe.cuh"

// ---- the persistent kernel ---------------------------------------------------------------------------------------
// (MK_BLOCKS_PER_SM resident blocks per SM: the register cap that lets them all fit, 128 registers either way)
// (the loop's own reads from the kernel parameter either way: with MK_CONST_PARAMS its code generation spilled)
#pragma push_macro("MK_PV")
#undef MK_PV
#define MK_PV(i) (P.v[i])
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
        if (threadIdx.x == 0) {
            s_abort = ld_volatile(ctrl + CTRL_ABORT);
            // claim the next ticket early (see schedule.py), or (claim_ahead == 0) at this task's signal
            // (task_signal): a ticket claimed early waits for this task's own dependency wait, however long, while
            // a free block could have run it
            if (PI(claim_ahead)) s_next = atomicAdd(ctrl + CTRL_TICKET, 1);
        }
        if (threadIdx.x < MK_REC_INTS) s_rec[threadIdx.x] = __ldg(tasks + (size_t)ticket * MK_REC_INTS + threadIdx.x);
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
#pragma pop_macro("MK_PV")

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

// The swizzled tiles' tensor map (128 bytes, into out; csrc/mk_tmap.h) of a row-major bf16 matrix of `rows` x K at
// `base` with boxes of 64 columns x box_rows rows (MK_SWZ builds). 0 on success, else mk_tmap.h's codes.
// MK_SWZ_3D builds: the 3D view (64 columns, rows, K / 64 column blocks) with boxes of box_rows rows of every column.
extern "C" int mk_encode_swizzled(void* out, const void* base, unsigned long long rows, int K, int box_rows) {
    CUtensorMap map;                        // (aligned here; `out` need not be)
    const int rc = MK_SWZ_3D ? mk_tmap_encode_swizzled_3d(&map, base, rows, K, box_rows)
                             : mk_tmap_encode_swizzled(&map, base, rows, K, box_rows);
    if (rc == 0) memcpy(out, &map, sizeof(map));
    return rc;
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

#if MK_CONST_PARAMS
// The parameters' trip to __constant__ memory (MK_CONST_PARAMS), per device: a ring of pinned host copies, so the
// copy is truly asynchronous (a copy from pageable memory may wait for the stream), each slot reused only after the
// copy that read it (its event; the engine keeps at most two steps in flight, so this never waits in practice).
// The copy waits for the previous launch on this device (whatever its stream): a launch must not see the constants
// change under it.
#define MK_PARAM_RING 8
struct ParamRing {
    long long* host = nullptr;                   // [MK_PARAM_RING][MK_NUM_PARAMS], pinned
    cudaEvent_t copied[MK_PARAM_RING] = {};
    cudaEvent_t launched = nullptr;
    unsigned next = 0;
};
static ParamRing g_param_ring[64];

static cudaError_t upload_params(int device, const long long* params, cudaStream_t st) {
    if (device < 0 || device >= 64) return cudaErrorInvalidDevice;
    ParamRing& r = g_param_ring[device];
    cudaError_t e = cudaSuccess;
    if (r.host == nullptr) {
        e = cudaHostAlloc(reinterpret_cast<void**>(&r.host), sizeof(long long) * MK_NUM_PARAMS * MK_PARAM_RING,
                          cudaHostAllocDefault);
        for (int i = 0; i < MK_PARAM_RING && e == cudaSuccess; i++)
            e = cudaEventCreateWithFlags(&r.copied[i], cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&r.launched, cudaEventDisableTiming);
        if (e != cudaSuccess) { r.host = nullptr; return e; }
    }
    const unsigned k = r.next++ % MK_PARAM_RING;
    e = cudaEventSynchronize(r.copied[k]);      // (that slot's copy, MK_PARAM_RING launches ago)
    if (e != cudaSuccess) return e;
    long long* h = r.host + (size_t)k * MK_NUM_PARAMS;
    memcpy(h, params, sizeof(long long) * MK_NUM_PARAMS);
    e = cudaStreamWaitEvent(st, r.launched, 0);  // (never recorded yet: no wait)
    if (e != cudaSuccess) return e;
    e = cudaMemcpyToSymbolAsync(c_params, h, sizeof(long long) * MK_NUM_PARAMS, 0, cudaMemcpyHostToDevice, st);
    if (e != cudaSuccess) return e;
    return cudaEventRecord(r.copied[k], st);
}

static cudaError_t record_launch(int device, cudaStream_t st) {
    return cudaEventRecord(g_param_ring[device].launched, st);
}
#endif

// Zeroes the control block and counters, then launches the step, all on `stream`.
extern "C" int mk_launch(int device, const long long* params, int grid, int smem_bytes, void* sync_ptr,
                         long long sync_bytes, void* stream) {
    cudaError_t e = select_and_size(device, smem_bytes);
    if (e != cudaSuccess) return (int)e;
    Params P;
    for (int i = 0; i < MK_NUM_PARAMS; i++) P.v[i] = params[i];
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    e = cudaMemsetAsync(sync_ptr, 0, (size_t)sync_bytes, st);
    if (e != cudaSuccess) return (int)e;
#if MK_CONST_PARAMS
    e = upload_params(device, params, st);
    if (e != cudaSuccess) return (int)e;
#endif
    mk_decode<<<grid, NT, smem_bytes, st>>>(P);
    e = cudaGetLastError();
#if MK_CONST_PARAMS
    if (e == cudaSuccess) e = record_launch(device, st);
#endif
    return (int)e;
}
