"""Diagnose the megakernel on a tiny config: run one decode step on the GPU (scratch poisoned with NaN) and the
CPU simulator's executor of the same task list on the GPU in bf16, then print each scratch buffer's difference.
The first buffer that disagrees points at the failing task kind.

    PYTHONPATH=tests python benchmarks/mk_debug.py [variant] [batch]

(the tiny configs and the scratch-poisoning hook are the tests' own helpers, tests/kernel_helpers.py)
"""

from __future__ import annotations

import sys

import torch

from kernel_helpers import clone_cache, decode_batch, make_cfg, poison_scratch, prefill_state, tiny_weights
from megakernel.kernel.backend import MegakernelBackend
from megakernel.kernel.plan import plan_for_rows
from megakernel.kernel.schedule import step_inputs
from megakernel.kernel.simulator import Simulator
from megakernel.model.cohere2_moe import Cohere2MoeModel


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "north_like"
    B = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    if name.startswith("north") and name[5:].isdigit():   # North dims, fewer layers, small vocab
        from megakernel.config import ModelConfig, north_mini_code_config
        from megakernel.model.weights import random_weights
        n = int(name[5:] or 3)
        cfg = ModelConfig.from_dict(dict(
            model_type="cohere2_moe", vocab_size=4096, hidden_size=2048, num_hidden_layers=n,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            layer_types=["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)],
            mlp_layer_types=["dense" if i == 0 else "sparse" for i in range(n)], sliding_window=4096,
            rope_parameters={"rope_theta": 50000.0, "rope_type": "default"}, prefix_dense_sliding_window_pattern=1,
            prefix_dense_intermediate_size=3072, intermediate_size=768, num_experts=128, num_experts_per_tok=8,
            expert_selection_fn="sigmoid", norm_topk_prob=False, num_shared_experts=0, rms_norm_eps=1e-6,
            logit_scale=1.0, tie_word_embeddings=True, max_position_embeddings=500000))
        w = random_weights(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    else:
        cfg = make_cfg(name)
        w = tiny_weights(cfg, device="cuda", dtype=torch.bfloat16)
    lens = [5 + 7 * i for i in range(B)]
    st = prefill_state(cfg, w, lens, device="cuda", block_size=64 if name[5:].isdigit() else 4)
    batch = decode_batch(st, list(range(3, 3 + B)), device="cuda")
    c_ref, c_mk, c_sim = st.cache, clone_cache(st.cache), clone_cache(st.cache)
    ref = Cohere2MoeModel(cfg, w).forward(batch, c_ref)
    split = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    be = MegakernelBackend(cfg, w, st.layout, max_batch=16, split_tokens=split, watchdog_s=3)
    poison_scratch(be)
    out = be.decode(batch, c_mk)
    torch.cuda.synchronize()
    plan = plan_for_rows(be.plans, B)          # the launch's plan (its tiles, its O items in the expert queue)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    tl = be.last_task_list
    sim = Simulator(plan, w)
    res = sim.step(si, tl, c_sim, seed=0)
    print(f"variant {name} B={B} tasks={len(tl.records)}")
    layered = ("h", "x", "q", "attn", "ao", "mact", "mout", "rlog", "route", "eact", "y")
    first = []
    for key in layered:
        t, s_, m = be.buf[key], sim.buf[key], sim.mask[key]
        for l in range(t.shape[0]):
            ml = m[l]
            if not bool(ml.any()):
                continue
            dl = (t[l].float()[ml] - s_[l].float()[ml]).abs()
            bad = float(dl.max()) > 0.05 * max(1.0, float(s_[l].float()[ml].abs().max()))
            if bad or torch.isnan(dl).any():
                rows = sorted(set(torch.nonzero((t[l].float() - s_[l].float()).abs() > 1e-3)[:, 0].tolist()))
                first.append((key, l, rows[:16]))
                break
    print("  first divergent layer per buffer (key, layer, rows):", first)
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
