"""The megakernel test hooks (tests/kernel_helpers.py), on the CPU: they wrap the backend's private steps on one
object, so check here that they change what they claim (one launch's task records, every launch's buffers) and
nothing else. The GPU tests rely on them."""

from __future__ import annotations

import numpy as np
import torch

from kernel_helpers import decode_batch, hang_launches, make_cfg, poison_scratch, prefill_state, tiny_weights
from megakernel.kernel import opcodes as O
from megakernel.kernel.plan import ModelPlan
from megakernel.kernel.schedule import build_tasks, step_inputs


class _FakeBackend:
    """The two private steps the hooks wrap, with MegakernelBackend's signatures, and its buffers."""

    device = torch.device("cpu")

    def __init__(self, tl) -> None:
        self.tl = tl
        self.scratch_bytes = torch.zeros(16, dtype=torch.uint8)
        self.part_o, self.part_lse = torch.zeros(4), torch.zeros(2)

    def _task_list(self, si):
        return self.tl, torch.from_numpy(self.tl.records.astype(np.int32))

    def _params(self, si, tl, tasks, kv, cache, logits, n_step):
        return tasks


def _task_list():
    cfg = make_cfg("north_like")
    st = prefill_state(cfg, tiny_weights(cfg), [5, 9])
    batch = decode_batch(st, [3, 4])
    plan = ModelPlan(cfg, st.layout, max_batch=4, n_workers=2)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    return si, build_tasks(plan, si.B, si.nsplit)


def test_hang_launches_adds_one_missing_arrival_to_the_chosen_launch_only():
    si, tl = _task_list()
    be = _FakeBackend(tl)
    hang_launches(be, lambda n: n == 2)
    first, second, third = (be._task_list(si)[1].numpy() for _ in range(3))
    assert np.array_equal(first, tl.records) and np.array_equal(third, tl.records)
    diff = np.argwhere(second != tl.records)
    assert len(diff) == 1 and diff[0][1] == O.R["w0t"]                  # one record waits for one more arrival
    row = diff[0][0]
    assert second[row, O.R["w0t"]] == tl.records[row, O.R["w0t"]] + 1 and tl.records[row, O.R["w0c"]] >= 0
    assert be._task_list(si)[0] is tl                                    # the names and targets stay the cached ones


def test_poison_scratch_fills_every_buffer_before_each_launch():
    si, tl = _task_list()
    be = _FakeBackend(tl)
    poison_scratch(be)
    logits = torch.zeros(2, 8)
    tasks = be._params(si, tl, "tasks", None, None, logits, 0)
    assert tasks == "tasks"
    assert bool((be.scratch_bytes == 0xFF).all()) and bool(be.part_o.isnan().all()) and bool(be.part_lse.isnan().all())
    assert bool(logits.isnan().all())


def _finish_with_error(tl, watchdog_s: float, **ctrl: int) -> None:
    """MegakernelBackend._wait on a finished launch whose control block holds `ctrl` (CTRL_FIELDS names): it raises
    what the host makes of the kernel's error."""
    from megakernel.kernel.backend import MegakernelBackend

    C = {n: i for i, n in enumerate(O.CTRL_FIELDS)}
    sync = torch.zeros(O.CTRL_INTS + len(tl.targets) + 64, dtype=torch.int32)
    for name, value in ctrl.items():
        sync[C[name]] = value

    class _Done:
        def query(self) -> bool:
            return True

    fake = type("FakeBackend", (), {"watchdog_ns": int(watchdog_s * 1e9)})()
    MegakernelBackend._wait(fake, _Done(), tl, sync)


def test_shared_memory_error_names_the_task_and_both_sizes():
    """A task whose layout needs more shared memory than the launch gave stops the step with ERR_SMEM; the host
    turns the control block into an error naming the task, its opcode and both sizes (the check the kernel makes
    before any task touches shared memory)."""
    import pytest

    from megakernel.kernel.backend import MegakernelFailure

    si, tl = _task_list()
    task = int(np.flatnonzero(tl.records[:, O.R["op"]] == O.Op.ATTN)[0])
    with pytest.raises(MegakernelFailure, match=rf"task {task} \(ATTN\) needs 240000 B of shared memory, the launch "
                                                r"gave 232448 B"):
        _finish_with_error(tl, 1.0, err_code=O.ERR_SMEM, err_task=task, err_value=240000, err_target=232448)


def test_stall_inside_the_paged_worker_names_the_wait():
    """A wait inside the paged MoE worker (on its own warps, not a counter) that passes the watchdog stops the step
    with ERR_STALL; the host raises MegakernelHang naming the task, its block, the wait and its sequence number."""
    import pytest

    from megakernel.kernel.backend import MegakernelHang

    si, tl = _task_list()
    task = int(np.flatnonzero(tl.records[:, O.R["op"]] == O.Op.MOE_WORKER)[0])
    with pytest.raises(MegakernelHang, match=rf"task {task} \(MOE_WORKER, block 7\) stalled 2.0s inside the paged MoE "
                                             r"worker waiting for a ring page to free \(sequence 25\)"):
        _finish_with_error(tl, 2.0, err_code=O.ERR_STALL, err_task=task, err_block=7,
                           err_value=list(O.STALL_WAITS).index("EMPTY"), err_target=25)
