"""The engine's decode backend on sm_90: one megakernel launch per decode step.

    backend = MegakernelBackend(cfg, weights, layout, max_batch=16)
    logits = backend.decode(batch, cache)          # fp32 [B, vocab]; K/V of the new tokens written into `cache`
    backend.last_tokens                             # greedy tokens chosen inside the kernel (device tensor [B])

A step that does not finish (a counter stuck past the watchdog, default 5 s, $MEGAKERNEL_WATCHDOG_S) aborts
inside the kernel; `decode` then raises MegakernelHang naming the stuck counters, and the next step starts clean
(counters are zeroed before every launch).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import time
from typing import Callable

import numpy as np
import torch

from megakernel.config import ModelConfig
from megakernel.errors import MegakernelError
from megakernel.kernel import build, opcodes as O
from megakernel.kernel.plan import ModelPlan, fused_norm_smem_bytes, plan_for_rows, tiling_plans
from megakernel.kernel.schedule import StepInputs, TaskList, TaskListBuilder, step_inputs
from megakernel.kernel.tuning import DEFAULT_TUNING, TUNING_KEYS, card_tuning, select_card_build, tuning_from_env
from megakernel.kv.cache import KVCache, KVLayout
from megakernel.model.cohere2_moe import ForwardBatch, ForwardTrace
from megakernel.model.layers import rope_inv_freq
from megakernel.model.decode_backend import DecodeBackend
from megakernel.model.weights import ModelWeights
from megakernel.transfer import to_device

log = logging.getLogger("megakernel")


class MegakernelHang(MegakernelError):
    """A decode step did not finish in time; the message names the stuck dependency counters."""


class MegakernelFailure(MegakernelError):
    """The kernel reported an error (bad opcode, launch failure)."""


def megakernel_available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """(True, "") when the decode megakernel can run on `device`, else (False, reason)."""
    if os.environ.get("MEGAKERNEL_DISABLE"):
        return False, "disabled by MEGAKERNEL_DISABLE"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        return False, f"device {dev} is not a CUDA device"
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(idx)
    if (major, minor) != (9, 0):
        return False, f"{torch.cuda.get_device_name(idx)} is sm_{major}{minor}; the megakernel needs sm_90 (H100/H200)"
    from megakernel.kernel.build import find_nvcc
    if find_nvcc() is None:
        return False, "nvcc not found to build the kernel (set CUDA_HOME or MEGAKERNEL_NVCC)"
    return True, ""


def build_knobs(tuning: dict[str, int]) -> dict[str, int]:
    """The plan knobs for `tuning` (TUNING_KEYS) under the selected build: knobs this build cannot run are turned off
    where they were not asked for (check_build_runs refuses them where they were)."""
    knobs = {k: v for k, v in tuning.items() if k != "batch_tiles"}
    if "fused_norm" not in knobs and build.switch_value("MK_SMALL_VEC") < 2:
        knobs["fused_norm"] = 0          # the default's register path is MK_SMALL_VEC >= 2's
    if "moe_pages" not in knobs and build.switch_value("MK_MOE_LOCAL") == 0:
        knobs["moe_pages"] = 0           # the paged worker is MK_MOE_LOCAL=1's
    if "attn_dsplit_rows" not in knobs and build.switch_value("MK_ATTN_DSPLIT") == 0:
        knobs["attn_dsplit_rows"] = 0    # (a build without the variant ignores the param: the plan says so too)
    return knobs


_TABLES_VERSIONS = itertools.count(1)   # one per backend's layer tables (MK_CONST_TABLES copies them when it changes)


def check_build_runs(plans: list[ModelPlan]) -> None:
    """ValueError if the selected build cannot run one of `plans` (a knob asked for that its switches leave out)."""
    plan = plans[-1]
    if build.switch_value("MK_CONST_TABLES") and plan.L > O.MAX_TABLE_LAYERS:
        raise ValueError(f"the MK_CONST_TABLES build keeps the layer tables in constant memory for at most "
                         f"{O.MAX_TABLE_LAYERS} layers; this model has {plan.L} (use MK_CONST_TABLES=0)")
    if any(p.pg_n for p in plans) and build.switch_value("MK_MOE_LOCAL") == 0:
        raise ValueError("moe_pages needs the kernel's MK_MOE_LOCAL=1 (the paged worker keeps its routing in shared "
                         "memory; a paged plan's large items do not fit the plain worker); this build has "
                         "MK_MOE_LOCAL=0")
    if plan.worker_topk and build.switch_value("MK_MOE_LOCAL") == 0:
        raise ValueError("worker_topk needs the kernel's MK_MOE_LOCAL=1 (the workers keep their routing in shared "
                         "memory); this build has MK_MOE_LOCAL=0")
    if plan.fused_norm and fused_norm_smem_bytes(plan.H) == 0 and build.switch_value("MK_SMALL_VEC") < 2:
        raise ValueError("fused_norm at this hidden size needs the kernel's MK_SMALL_VEC>=2 (the fused tiles keep "
                         "the residual in registers; the plan leaves no shared memory for it)")


def check_page_layout(plans: list[ModelPlan], lib_slots: int, lib_page_bytes: int, lib_page_warps: int) -> None:
    """ValueError if a paged plan lays out another count of item slots, another ring page size or another count of
    computing warps per page than the loaded library was built with (its mk_page_slots, mk_page_bytes and
    mk_page_warps: MK_PAGE_SLOTS, MK_PAGE_BYTES, MK_PG_PAGE_WARPS): the kernel would index shared memory the plan gave
    to something else, or refuse the ring. (The plan reads them from $MEGAKERNEL_KERNEL_DEFINES when it is made, the
    library when it was loaded.)"""
    for p in plans:
        if not p.pg_n:
            continue
        for name, planned, built in (("MK_PAGE_SLOTS", p.pg_slots, lib_slots),
                                     ("MK_PAGE_BYTES", p.pg_page_bytes, lib_page_bytes),
                                     ("MK_PG_PAGE_WARPS", p.pg_page_warps, lib_page_warps)):
            if planned != built:
                raise ValueError(f"the paged plan for {p.max_batch} rows lays out {name}={planned}; the loaded "
                                 f"kernel library has {name}={built} (make the plans and load the library under the "
                                 "same MEGAKERNEL_KERNEL_DEFINES)")


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


class MegakernelBackend(DecodeBackend):
    name = "megakernel"

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, layout: KVLayout, max_batch: int = 16, *,
                 split_tokens: int | None = None, n_workers: int | None = None, watchdog_s: float | None = None,
                 arch: str = "sm_90a") -> None:
        ok, why = megakernel_available(weights.device)
        if not ok:
            raise RuntimeError(f"decode megakernel unavailable: {why}")
        if weights.dtype != torch.bfloat16:
            raise ValueError(f"the megakernel runs bf16 weights, got {weights.dtype}")
        max_batch = min(max_batch, O.MAX_BATCH)     # larger decode batches run as several launches
        self.cfg, self.w, self.layout = cfg, weights, layout
        self.device = weights.device
        self.dev_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.arch = arch
        # this card's build switches (tuning.CARD_SWITCHES) under $MEGAKERNEL_KERNEL_DEFINES, before the first load:
        # the plans' shared-memory layouts read the same selection (build.page_bytes, ...)
        card = torch.cuda.get_device_name(self.dev_index)
        self.card_switches = select_card_build(card)
        self.lib = build.load(arch)
        # MK_ATTN_BULK=2 builds: attention's K/V by tensor copies through maps of the KV pools (_kv_tensor_maps)
        self.attn_tensor = build.switch_value("MK_ATTN_BULK") == 2
        self._kv_maps: tuple | None = None   # (the pools' pointers and sizes, the maps on the device)
        self._lib_prof = None                # the profiling build, loaded on first use
        self._profile_next = False
        self.last_profile = None             # timeline.RawProfile of the last profiled launch
        info = (ctypes.c_int * 4)()
        rc = self.lib.mk_device_info(self.dev_index, info)
        if rc:
            raise MegakernelFailure(f"cudaGetDeviceProperties failed: {self.lib.mk_error_string(rc).decode()}")
        self.num_sms, self.smem_optin = info[0], info[3]
        self.grid = self.num_sms * O.BLOCKS_PER_SM      # (opcodes.BLOCKS_PER_SM: 1, or the two-block experiment)
        self.card_tuning = card_tuning(card)          # this card's plan overrides
        tuning = {**self.card_tuning, **tuning_from_env()}
        if split_tokens is not None:
            tuning["split_tokens"] = split_tokens
        if n_workers is not None:
            tuning["n_workers"] = n_workers
        tuning.setdefault("n_workers", self.grid)
        self.max_batch = max_batch
        self._tuning: dict[str, int] = {}
        self.set_tuning(**tuning)
        wd = watchdog_s if watchdog_s is not None else float(os.environ.get("MEGAKERNEL_WATCHDOG_S", "5"))
        self.watchdog_ns = int(wd * 1e9)
        self._alloc_static()
        self.last_tokens: torch.Tensor | None = None
        self.last_task_list: TaskList | None = None

    # ---- static state ------------------------------------------------------------------------------------------
    def _alloc_static(self) -> None:
        p, dev, w = self.plan, self.device, self.w
        spec = p.scratch_spec(torch.bfloat16, n_lm_tiles=max(q.n_lm_tiles for q in self.plans))
        offs, total = {}, 0
        for name, (shape, dt) in spec.items():
            n = int(np.prod(shape)) * torch.empty((), dtype=dt).element_size()
            offs[name] = (total, shape, dt, n)
            total += _align(n)
        self.scratch_bytes = torch.empty(total, dtype=torch.uint8, device=dev)
        self.buf: dict[str, torch.Tensor] = {}
        for name, (off, shape, dt, n) in offs.items():
            self.buf[name] = self.scratch_bytes[off:off + n].view(dt).view(shape)
        self.sync = torch.zeros(p.sync_ints, dtype=torch.int32, device=dev)
        self.part_o = torch.empty(1, dtype=torch.float32, device=dev)
        self.part_lse = torch.empty(1, dtype=torch.float32, device=dev)
        self.layer_info = torch.from_numpy(p.layer_info()).to(dev)
        self.tables_version = next(_TABLES_VERSIONS)   # (the tables below are built once per backend)
        self.inv_freq = rope_inv_freq(p.cfg).to(dev)
        self._keep: list[torch.Tensor] = []

        def ptr(t: torch.Tensor | None) -> int:
            if t is None:
                return 0
            if t.device != dev or t.dtype != torch.bfloat16:
                raise ValueError("every weight must be bf16 on the backend's device")
            if not t.is_contiguous():
                t = t.contiguous()
            self._keep.append(t)
            return t.data_ptr()

        wp = np.zeros((p.L, O.WPTR_INTS), dtype=np.int64)
        F = {n: i for i, n in enumerate(O.WPTR_FIELDS)}
        for l, lw in enumerate(w.layers):
            wp[l, F["norm"]] = ptr(lw.norm_weight)
            wp[l, F["qkv"]] = ptr(lw.qkv)
            wp[l, F["qkv_bias"]] = ptr(lw.qkv_bias)
            wp[l, F["o"]] = ptr(lw.o)
            wp[l, F["o_bias"]] = ptr(lw.o_bias)
            mlp = lw.dense if lw.dense is not None else (lw.moe.shared if lw.moe is not None else None)
            if mlp is not None:
                wp[l, F["mlp_gu"]] = ptr(mlp.gate_up)
                wp[l, F["mlp_down"]] = ptr(mlp.down)
            if lw.moe is not None:
                wp[l, F["router"]] = ptr(lw.moe.router)
                wp[l, F["e_gu"]] = ptr(lw.moe.experts_gate_up)
                wp[l, F["e_down"]] = ptr(lw.moe.experts_down)
        self.wptrs = torch.from_numpy(wp).to(dev)
        self.embed_ptr, self.final_norm_ptr, self.lm_head_ptr = ptr(w.embed), ptr(w.final_norm), ptr(w.lm_head)
        self.step_dev = torch.zeros(1, dtype=torch.int32, device=dev)

    def _kv_tensor_maps(self, kv) -> int:
        """MK_ATTN_BULK=2: the device address of one tensor map per KV group's pool (16-token boxes of one kv head,
        128-byte swizzle; csrc/mk_tmap.h mk_tmap_encode_swizzled_3d), encoded again only when a pool moves; 0 where the
        tensor path does not apply (head_dim not 64 or 128, blocks not a multiple of 16 tokens): attention then
        loads its chunks by cp.async."""
        p = self.plan
        if not self.attn_tensor or p.d not in (64, 128) or p.layout.block_size % 16:
            return 0
        row_elems = p.nkv * p.d
        key = tuple((t.data_ptr(), t.numel()) if t is not None else (0, 0) for t in kv)
        if self._kv_maps is None or self._kv_maps[0] != key:
            host = np.zeros((2, O.TMAP_BYTES), dtype=np.uint8)
            for g, t in enumerate(kv[:2]):
                if t is None:
                    continue
                rc = self.lib.mk_encode_kv(host[g].ctypes.data, t.data_ptr(), t.numel() // row_elems, row_elems,
                                           16, p.d // 64)
                if rc:
                    raise MegakernelFailure(f"tensor map of KV group {g}'s pool failed: {rc}")
            self._kv_maps = (key, torch.from_numpy(host).to(self.device))
        return self._kv_maps[1].data_ptr()

    def set_tuning(self, **tuning: int) -> None:
        """(Re)build the plans from TUNING_KEYS overrides (measurements; the task lists are rebuilt). `self.plan`
        (tiles for max_batch rows) sizes the scratch; with batch_tiles=1, launches of fewer rows use a plan whose
        GEMV tiles are larger where those rows' inputs leave room (e.g. the O projection at <= 11 rows)."""
        bad = set(tuning) - set(TUNING_KEYS)
        if bad:
            raise ValueError(f"unknown tuning keys {sorted(bad)}")
        self._tuning = {**DEFAULT_TUNING, **self._tuning, **tuning}   # what was set before stays unless given again
        batch_tiles = self._tuning["batch_tiles"]
        plans = tiling_plans(self.cfg, self.layout, self.max_batch, bool(batch_tiles), **build_knobs(self._tuning))
        plan = plans[-1]
        plan.check_supported()
        check_build_runs(plans)
        for lib in (self.lib, self._lib_prof):
            if lib is not None:
                check_page_layout(plans, lib.mk_page_slots(), lib.mk_page_bytes(), lib.mk_page_warps())
        per_block = min(self.smem_optin, O.SMEM_LIMIT)
        for p in plans:
            need = p.smem_bytes()
            if need > per_block - O.SMEM_RESERVE:       # (the rest: the kernel's static smem)
                raise ValueError(f"kernel needs {need} B of shared memory, the GPU allows {per_block} per block at "
                                 f"{O.BLOCKS_PER_SM} block(s) per SM")
            self._check_resident(need)
        self.plan, self.plans, self.batch_tiles = plan, plans, batch_tiles
        self.smem = plan.smem_bytes()
        lm_tiles = max(q.n_lm_tiles for q in plans)
        if hasattr(self, "buf") and self.buf["lm_best"].shape[0] < lm_tiles:     # re-tuned to smaller LM tiles
            self.buf["lm_best"] = torch.empty(lm_tiles, plan.max_batch, 2, dtype=torch.float32, device=self.device)
        self._tasks: dict[tuple, tuple[TaskList, torch.Tensor]] = {}    # by (tile_batch, step signature)
        # every batch size's list without its attention splits: a new signature (a row crossed a split boundary)
        # only fills those in (b1 8K 8.6 -> 2.6 ms of host time on the CI machine)
        self._builders: dict[tuple[int, int], TaskListBuilder] = {}

    def _check_resident(self, smem: int) -> None:
        """Every block of a launch must be resident at once (schedule.py's no-deadlock argument): refuse a shared-memory
        size at which fewer than BLOCKS_PER_SM blocks fit an SM."""
        n = ctypes.c_int(0)
        rc = self.lib.mk_occupancy(self.dev_index, smem, ctypes.byref(n))
        if rc:
            raise MegakernelFailure(f"cudaOccupancyMaxActiveBlocksPerMultiprocessor failed: "
                                    f"{self.lib.mk_error_string(rc).decode()}")
        if n.value < O.BLOCKS_PER_SM:
            raise ValueError(f"only {n.value} block(s) of the kernel fit an SM with {smem} B of shared memory; the "
                             f"launch needs {O.BLOCKS_PER_SM} resident per SM")

    def _plan_for(self, B: int) -> ModelPlan:
        return plan_for_rows(self.plans, B)

    def _task_list(self, si: StepInputs) -> tuple[TaskList, torch.Tensor]:
        plan = self._plan_for(si.B)
        key = (plan.tb, si.signature)
        hit = self._tasks.get(key)
        if hit is None:
            builder = self._builders.get((plan.tb, si.B))
            if builder is None:
                builder = self._builders[(plan.tb, si.B)] = TaskListBuilder(plan, si.B)
            tl = builder.build(si.nsplit)
            hit = (tl, to_device(torch.from_numpy(tl.records), torch.int32, self.device))
            if len(self._tasks) >= 16:
                self._tasks.pop(next(iter(self._tasks)))
            self._tasks[key] = hit
        return hit

    def profile_next_step(self) -> None:
        """Run the next launch on the profiling build (every task stamped); its records land in `last_profile`
        once that launch's completion check has run. The launches after it use the normal build again."""
        if self._lib_prof is None:
            lib = build.load(self.arch, profile=True)
            check_page_layout(self.plans, lib.mk_page_slots(), lib.mk_page_bytes(), lib.mk_page_warps())
            self._lib_prof = lib
        self._profile_next = True

    # ---- one step ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode_async(self, batch: ForwardBatch, cache: KVCache, trace: ForwardTrace | None = None
                     ) -> tuple[torch.Tensor, Callable[[], None]]:
        """Launch one decode step without waiting for it (nor for earlier GPU work: inputs are uploaded from
        pinned memory, and the input token ids may be device values the host has not read yet). Returns the
        logits (valid in stream order) and a check that waits for the launch and raises MegakernelHang /
        MegakernelFailure if it hung or failed."""
        p = self.plan
        B = batch.num_seqs
        if batch.starts != list(range(B + 1)):
            raise ValueError("the megakernel decodes exactly one new token per sequence")
        positions = batch.host_positions()
        launches = []
        for a in range(0, B, p.max_batch):          # several launches of at most max_batch rows
            b = min(B, a + p.max_batch)
            sub_trace = ForwardTrace() if trace is not None else None
            launches.append((*self._launch(batch.input_ids[a:b], positions[a:b], batch.block_tables[a:b], cache,
                                           sub_trace), sub_trace))
        if trace is not None:
            per_launch = [t.experts for *_, t in launches]
            trace.experts.extend(torch.cat(x) if len(x) > 1 else x[0] for x in zip(*per_launch))
        logits = torch.cat([x[0] for x in launches]) if len(launches) > 1 else launches[0][0]
        self.last_tokens = torch.cat([x[1] for x in launches]) if len(launches) > 1 else launches[0][1]
        rows = batch.logits_rows
        if rows is not None:
            logits = logits[rows]
        checks = [x[2] for x in launches]

        def check() -> None:
            for c in checks:
                c()

        return logits, check

    def _launch(self, input_ids: torch.Tensor, positions: list[int], tables: list, cache: KVCache,
                trace: ForwardTrace | None) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None]]:
        p = self.plan
        B = len(positions)
        si = step_inputs(p, [0] * B, positions, tables)        # token ids are copied in on the device below
        tl, tasks = self._task_list(si)
        self.last_task_list = tl
        dev = self.device
        g, d = p.g, p.d
        if self.part_o.numel() < max(1, tl.n_partials) * g * d:
            self.part_o = torch.empty(max(1, tl.n_partials) * g * d * 2, dtype=torch.float32, device=dev)
            self.part_lse = torch.empty(max(1, tl.n_partials) * g * 2, dtype=torch.float32, device=dev)
        # per-step inputs: one fresh pinned buffer (the previous one may still be in flight), one copy
        n_step, n_tab = len(si.step), len(si.tables)
        if self.step_dev.numel() < n_step + n_tab:
            self.step_dev = torch.zeros(_align(n_step + n_tab, 1024), dtype=torch.int32, device=dev)
        staged = torch.from_numpy(np.concatenate([si.step, si.tables]).astype(np.int32)).pin_memory()
        self.step_dev[:n_step + n_tab].copy_(staged, non_blocking=True)
        self.step_dev[:B].copy_(input_ids)                     # the step's token ids, straight from the device
        logits = torch.empty(B, self.cfg.vocab_size, dtype=torch.float32, device=dev)
        kv = [t for t in cache.kv] + [None] * (2 - len(cache.kv))
        for t in cache.kv:
            if t.dtype != torch.bfloat16 or t.device != dev or not t.is_contiguous():
                raise ValueError("the KV cache must be contiguous bf16 on the backend's device")
        prof = self._profile_buffers(tl) if self._profile_next else None
        self._profile_next = False
        params = self._params(si, tl, tasks, kv, cache, logits, n_step, prof)
        stream = torch.cuda.current_stream(dev)
        lib = self.lib if prof is None else self._lib_prof
        rc = lib.mk_launch(self.dev_index, params.ctypes.data_as(
            ctypes.POINTER(ctypes.c_longlong)), self.grid, self._plan_for(B).smem_bytes(),
            self.sync.data_ptr(), p.sync_ints * 4, stream.cuda_stream)
        if rc:
            raise MegakernelFailure(f"megakernel launch failed: {self.lib.mk_error_string(rc).decode()}")
        # the control block and counters of this launch, read back without waiting (the next launch reuses them)
        n_sync = O.CTRL_INTS + p.n_counters
        sync_host = torch.empty(n_sync, dtype=torch.int32, pin_memory=True)
        sync_host.copy_(self.sync[:n_sync], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(stream)
        tokens = self.buf["tokens"][:B].clone()
        if trace is not None:
            for m in range(p.Lm):
                ids = self.buf["route"][m, p.r_topk_ids:p.r_topk_ids + p.n_pairs].view(p.max_batch, p.topk)[:B]
                trace.experts.append(ids.long().clone())
        if prof is None:
            return logits, tokens, lambda: self._wait(ev, tl, sync_host)

        def check_and_keep_profile() -> None:
            self._wait(ev, tl, sync_host)
            self.last_profile = self._read_profile(prof, tl, si)

        return logits, tokens, check_and_keep_profile

    def _profile_buffers(self, tl: TaskList) -> dict[str, torch.Tensor]:
        p = self.plan
        per_layer = max(q.n_slots * (q.gu_tiles + q.dn_tiles) + q.o_items for q in self.plans)
        return dict(tasks=torch.full((len(tl.records), O.PROF_INTS), -1, dtype=torch.int64, device=self.device),
                    items=torch.full((max(1, p.Lm), per_layer, O.PROF_INTS), -1, dtype=torch.int64,
                                     device=self.device),
                    blocks=torch.zeros(self.grid, O.PROF_BLOCK_INTS, dtype=torch.int64, device=self.device),
                    per_layer=torch.tensor(per_layer))

    def _read_profile(self, prof: dict[str, torch.Tensor], tl: TaskList, si: StepInputs):
        from megakernel.kernel.timeline import RawProfile, task_bytes

        items = prof["items"].reshape(-1, O.PROF_INTS).cpu().numpy()
        ran = items[items[:, O.PROF_FIELDS.index("op")] >= 0]          # the work items this step had
        nbytes, item_bytes = task_bytes(self._plan_for(si.B), si, tl.records)
        Bm = self.plan.max_batch
        return RawProfile(prof["tasks"].cpu().numpy(), ran, prof["blocks"].cpu().numpy(), tl.records, nbytes,
                          item_bytes, dict(tl.names),
                          meta=dict(batch=si.B, positions=si.step[Bm:Bm + si.B].tolist(), grid=self.grid))

    def _params(self, si, tl, tasks, kv, cache, logits, n_step, prof=None) -> np.ndarray:
        p, cfg = self._plan_for(si.B), self.cfg       # the launch's tiling; scratch and counters are the same
        v = np.zeros(O.NUM_PARAMS, dtype=np.int64)
        P = O.P
        f2i = lambda x: int(np.float32(x).view(np.int32))
        base = self.sync.data_ptr()
        vals = dict(
            tasks=tasks.data_ptr(), n_tasks=tasks.shape[0], ctrl=base, counters=base + 4 * O.CTRL_INTS,
            n_counters=p.n_counters, moe_work=base + 4 * (O.CTRL_INTS + p.n_counters),
            layer_info=self.layer_info.data_ptr(), wptrs=self.wptrs.data_ptr(), inv_freq=self.inv_freq.data_ptr(),
            embed=self.embed_ptr, final_norm=self.final_norm_ptr, lm_head=self.lm_head_ptr,
            kv0=kv[0].data_ptr() if kv[0] is not None else 0, kv1=kv[1].data_ptr() if kv[1] is not None else 0,
            nblk0=cache.num_blocks[0], nblk1=cache.num_blocks[1] if len(cache.num_blocks) > 1 else 0,
            step=self.step_dev.data_ptr(), tables=self.step_dev.data_ptr() + 4 * n_step,
            part_o=self.part_o.data_ptr(), part_lse=self.part_lse.data_ptr(), logits=logits.data_ptr(),
            B=si.B, Bm=p.max_batch, H=p.H, n_heads=p.nh, n_kv=p.nkv, head_dim=p.d, q_dim=p.nh * p.d,
            tables_version=self.tables_version, E=p.E, topk=p.topk, I=p.I,
            I_mlp=p.I_mlp, V=cfg.vocab_size, L=p.L, n_groups=p.n_groups, block_size=p.layout.block_size,
            split_tokens=si.split_tokens, attn_stages=p.attn_stages, attn_dsplit=int(si.B <= p.attn_dsplit_rows),
            l2_pf=p.l2_prefetch, topk_warm=p.topk_warm, worker_claim_early=p.worker_claim_early,
            cpl=p.cpl, c_gu=p.c_gu,
            gu_rows=p.gu_rows, gu_tiles=p.gu_tiles, dn_rows=p.dn_rows, dn_tiles=p.dn_tiles, n_slots=p.n_slots,
            wbuf=p.wbuf, moe_wbuf=p.moe_wbuf, lm_wbuf=p.lm_wbuf, claim_ahead=p.claim_ahead,
            moe_claim_late=p.moe_claim_late, topk_warp=p.topk_warp, o_items=p.o_items, o_after=p.o_after,
            dn_lag=p.queue_dn_lag, slot_pairs=p.slot_pairs,
            o_rows=p.o_rows, c_comb=p.c_comb,
            combine_parts=p.combine_parts, worker_topk=p.worker_topk,
            pg_n=p.pg_n, pg_in_off=p.pg_in_off, pg_in_bytes=p.pg_in_bytes, pg_out_off=p.pg_out_off,
            pg_out_rows=p.pg_out_rows, pg_state_off=p.pg_state_off, pg_claim_late=p.moe_pages_claim_late,
            pg_rows=p.pg_rows, pg_x_off=p.pg_x_off, pg_x_item=p.pg_x_item, pg_early=p.moe_pages_early,
            n_pairs=p.n_pairs, r_stride=p.r_stride, r_slot_expert=p.r_slot_expert, r_slot_start=p.r_slot_start,
            r_slot_cnt=p.r_slot_cnt, r_pair_row=p.r_pair_row, r_pair_rank=p.r_pair_rank, r_pair_w=p.r_pair_w,
            r_topk_ids=p.r_topk_ids,
            norm_type=O.NORM_RMS if cfg.norm_type == "rms" else O.NORM_LAYER, norm_eps=f2i(cfg.norm_eps),
            logit_scale=f2i(cfg.logit_scale), attn_scale=f2i(cfg.head_dim ** -0.5),
            sel_fn=O.SEL_SOFTMAX if cfg.expert_selection_fn == "softmax" else O.SEL_SIGMOID,
            norm_topk=int(cfg.norm_topk_prob),
            shared_comb=O.COMB_SUM if cfg.shared_expert_combination == "sum" else O.COMB_AVERAGE,
            watchdog_ns=self.watchdog_ns,
            prof=prof["tasks"].data_ptr() if prof else 0, prof_items=prof["items"].data_ptr() if prof else 0,
            prof_items_per_layer=int(prof["per_layer"]) if prof else 0,
            prof_blocks=prof["blocks"].data_ptr() if prof else 0,
            kv_tmaps=self._kv_tensor_maps(kv),
        )
        for name, t in self.buf.items():
            vals[name] = t.data_ptr()
        missing = set(O.PARAM_FIELDS) - set(vals)
        if missing:
            raise AssertionError(f"kernel parameters not set: {sorted(missing)}")
        for name, x in vals.items():
            v[P[name]] = int(x)
        return v

    def _wait(self, ev: torch.cuda.Event, tl: TaskList, sync_host: torch.Tensor) -> None:
        # Host-side backstop: the in-kernel watchdog ends a stuck step; if even that fails, do not hang forever.
        deadline = time.monotonic() + self.watchdog_ns / 1e9 + 30.0
        spins = 0
        while not ev.query():
            spins += 1
            if spins > 200:
                time.sleep(50e-6)
            if time.monotonic() > deadline:
                err = MegakernelHang("decode megakernel did not finish within the host deadline; the GPU may be "
                                     "unusable until the process exits")
                err.device_stuck = True      # work queued behind it will not finish either
                raise err
        ctrl = sync_host[:O.CTRL_INTS].tolist()
        C = {n: i for i, n in enumerate(O.CTRL_FIELDS)}
        code = ctrl[C["err_code"]]
        if code == 0:
            return
        counters = sync_host[O.CTRL_INTS:].numpy()
        if code == O.ERR_WATCHDOG:
            c, val, tgt, task = (ctrl[C[k]] for k in ("err_counter", "err_value", "err_target", "err_task"))
            op = O.Op(int(tl.records[task, 0])).name if 0 <= task < len(tl.records) else "?"
            short = [f"{tl.names.get(i, f'counter {i}')}: {int(counters[i])}/{t}"
                     for i, t in sorted(tl.targets.items()) if counters[i] < t][:8]
            raise MegakernelHang(
                f"decode megakernel watchdog: task {task} ({op}) waited {self.watchdog_ns / 1e9:.1f}s on "
                f"{tl.names.get(c, f'counter {c}')} (counter {c}) at {val}, needs {tgt}. Counters short of their "
                f"targets: {'; '.join(short)}")
        task = ctrl[C["err_task"]]
        op = O.Op(int(tl.records[task, 0])).name if 0 <= task < len(tl.records) else "?"
        if code == O.ERR_SMEM:
            raise MegakernelFailure(
                f"decode megakernel: task {task} ({op}) needs {ctrl[C['err_value']]} B of shared memory, the launch "
                f"gave {ctrl[C['err_target']]} B: the plan's layout (plan.smem_bytes) and the kernel's disagree")
        if code == O.ERR_STALL:
            what = list(O.STALL_WAITS.values())
            w = ctrl[C["err_value"]]
            raise MegakernelHang(
                f"decode megakernel watchdog: task {task} ({op}, block {ctrl[C['err_block']]}) stalled "
                f"{self.watchdog_ns / 1e9:.1f}s inside the paged MoE worker waiting for "
                f"{what[w] if 0 <= w < len(what) else f'wait {w}'} (sequence {ctrl[C['err_target']]})")
        raise MegakernelFailure(f"decode megakernel error code {code} at task {task} ({op})")
