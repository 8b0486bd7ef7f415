"""GPU tests of the megakernel's profiling build (sm_90; run through the device tool): every task of the list is
recorded exactly once, each task's stamps are in order, no dependency wait ends before its producers ended, and the
profiled step computes what the normal build computes."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import clone_cache, decode_batch, make_cfg, prefill_state, tiny_weights

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                                 reason="needs an sm_90 GPU")]


@pytest.mark.parametrize("variant,B", [("north_like", 3), ("softmax_shared_avg_untied_g4", 8)])
def test_profiled_step_records_every_task_in_order(variant, B):
    from megakernel.kernel import opcodes as O
    from megakernel.kernel import timeline as T
    from megakernel.kernel.backend import MegakernelBackend
    from megakernel.kernel.plan import plan_for_rows

    cfg = make_cfg(variant)
    w = tiny_weights(cfg, device="cuda", dtype=torch.bfloat16, seed=B)
    st = prefill_state(cfg, w, [5 + 7 * i for i in range(B)], device="cuda", seed=B)
    be = MegakernelBackend(cfg, w, st.layout, max_batch=16, split_tokens=5, watchdog_s=5)
    batch = decode_batch(st, list(range(3, 3 + B)), device="cuda")
    normal = be.decode(batch, clone_cache(st.cache))
    be.profile_next_step()
    profiled = be.decode(batch, clone_cache(st.cache))
    raw = be.last_profile
    tl = T.to_timeline(raw)
    violations = T.check_invariants(raw, tl)
    print(f"{variant} B={B}: {len(raw.tasks)} tasks, {len(raw.items)} MoE items, step {tl.step_ns / 1e3:.1f} us, "
          f"timer step {tl.timer_step_ns:.0f} ns")
    assert violations == [], violations
    ran = plan_for_rows(be.plans, B)                         # the plan this launch ran (o_queue: by rows)
    item_kinds = {O.PROF_ITEM_GU, O.PROF_ITEM_DN} | ({O.PROF_ITEM_O} if ran.o_items else set())
    assert len(raw.items) > 0 and set(raw.items[:, O.PROF_FIELDS.index("op")].tolist()) <= item_kinds
    assert torch.nn.functional.cosine_similarity(profiled, normal, dim=-1).min() > 0.9999
    again = be.decode(batch, clone_cache(st.cache))          # the next launch is the normal build again
    assert be.last_profile is raw
    assert torch.nn.functional.cosine_similarity(again, normal, dim=-1).min() > 0.9999
    s = T.summarize(tl)
    items = ("MOE_GATE_UP", "MOE_DOWN", "OPROJ_ITEM")
    assert sum(d["count"] for name, d in s["per_op"].items() if name not in items) == \
        len(raw.records)
