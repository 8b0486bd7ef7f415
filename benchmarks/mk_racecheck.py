"""Driver for compute-sanitizer (racecheck/memcheck): the decode state is prepared on the CPU with the PyTorch
path, copied to the GPU, and the only GPU kernel of interest is one megakernel step (tiny config).

    PYTHONPATH=tests compute-sanitizer --tool racecheck --kernel-name kns=mk_decode python3 benchmarks/mk_racecheck.py [B]
    PYTHONPATH=tests python3 benchmarks/mk_racecheck.py B STEPS      (the same step STEPS times, no sanitizer: a stress
                                                                      run for hangs that need a rare schedule)

(the tiny configs are the tests' own helpers, tests/kernel_helpers.py). Plan knobs as for any engine:
MEGAKERNEL_MK_TUNING="moe_pages_max=6" (e.g. the 6-page ring of the 32 KB page builds, with 16 KB pages).
"""

from __future__ import annotations

import sys
import time

import torch

from kernel_helpers import decode_batch, make_cfg, prefill_state, tiny_weights
from megakernel.kernel.backend import MegakernelBackend
from megakernel.model.cohere2_moe import Cohere2MoeModel


def main() -> None:
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    cfg = make_cfg("north_like")
    w = tiny_weights(cfg, dtype=torch.bfloat16, scale=1.0)
    st = prefill_state(cfg, w, [5 + 7 * i for i in range(B)])
    batch = decode_batch(st, list(range(3, 3 + B)))
    ref = Cohere2MoeModel(cfg, w).forward(batch, st.cache)          # CPU reference (bf16)
    wg = w.to("cuda")
    cache = st.cache
    cache.kv = [t.to("cuda") for t in cache.kv]
    batch.input_ids, batch.positions = batch.input_ids.cuda(), batch.positions.cuda()
    be = MegakernelBackend(cfg, wg, st.layout, max_batch=16, split_tokens=3)
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    print(f"plan: {be.plan.pg_n} ring pages", flush=True)
    t0 = time.monotonic()
    for i in range(steps):              # (the same step again: it rewrites the same cache positions)
        out = be.decode(batch, cache).cpu()
        if steps > 1 and (i + 1) % max(1, steps // 10) == 0:
            print(f"{i + 1} of {steps} steps ({time.monotonic() - t0:.1f} s)", flush=True)
    cos = torch.nn.functional.cosine_similarity(out, ref.float(), dim=-1)
    print(f"B={B} finite={bool(torch.isfinite(out).all())} cos vs CPU torch: {cos.tolist()}")


if __name__ == "__main__":
    main()
