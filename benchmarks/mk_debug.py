"""Diagnose the megakernel on a tiny config: run one decode step on the GPU (scratch poisoned with NaN) and the
CPU simulator's executor of the same task list on the GPU in bf16, then print each scratch buffer's difference.
The first buffer that disagrees points at the failing task kind.

    python benchmarks/mk_debug.py [variant] [batch]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernel"))

from kernel_helpers import VARIANTS, clone_cache, decode_batch, make_cfg, prefill_state, tiny_weights  # noqa: E402

from megakernel.kernel.backend import MegakernelBackend  # noqa: E402
from megakernel.kernel.schedule import step_inputs  # noqa: E402
from megakernel.kernel.simulator import Simulator  # noqa: E402
from megakernel.model.cohere2_moe import Cohere2MoeModel  # noqa: E402


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "north_like"
    B = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    cfg = make_cfg(name)
    w = tiny_weights(cfg, device="cuda", dtype=torch.bfloat16)
    lens = [5 + 7 * i for i in range(B)]
    st = prefill_state(cfg, w, lens, device="cuda")
    batch = decode_batch(st, list(range(3, 3 + B)), device="cuda")
    c_ref, c_mk, c_sim = st.cache, clone_cache(st.cache), clone_cache(st.cache)
    ref = Cohere2MoeModel(cfg, w).forward(batch, c_ref)
    be = MegakernelBackend(cfg, w, st.layout, max_batch=16, split_tokens=3, watchdog_s=3)
    be.poison = True
    out = be.decode(batch, c_mk)
    torch.cuda.synchronize()
    plan = be.plan
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    tl = be.last_task_list
    sim = Simulator(plan, w)
    res = sim.step(si, tl, c_sim, seed=0)
    print(f"variant {name} B={B} tasks={len(tl.records)}")
    for key, t in be.buf.items():
        s = sim.buf[key]
        m = sim.mask[key]
        a, b = t.float()[m], s.float()[m]
        if a.numel() == 0:
            continue
        nan = int(torch.isnan(a).sum())
        diff = (a - b).abs()
        diff = diff[~torch.isnan(diff)]
        mx = float(diff.max()) if diff.numel() else float("nan")
        scale = float(b.abs().max())
        print(f"  {key:8s} elems {a.numel():8d} nan {nan:6d} max|diff| {mx:.3e} (max|sim| {scale:.3e})")
    for i, (x, y) in enumerate(zip(c_mk.kv, c_sim.kv)):
        print(f"  kv group {i}: max|mk - sim| {float((x.float() - y.float()).abs().max()):.3e}, "
              f"max|mk - torch| {float((x.float() - c_ref.kv[i].float()).abs().max()):.3e}")
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())
    print(f"  logits: max rel mk-vs-torch {rel(out, ref):.3e}, sim-vs-torch {rel(res.logits, ref):.3e}, "
          f"mk-vs-sim {rel(out, res.logits):.3e}; nan {int(torch.isnan(out).sum())}")
    print(f"  tokens mk {be.last_tokens.tolist()} sim {res.tokens.tolist()} torch {ref.argmax(-1).tolist()}")


if __name__ == "__main__":
    main()
