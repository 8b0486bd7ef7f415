"""Shared set-up for the megakernel tests: tiny configs, a prefilled paged cache, decode batches, and the test
hooks that poison the kernel's scratch or make a launch hang (kept here, out of the backend's API)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

import torch

from megakernel.config import ModelConfig
from megakernel.kv.block_manager import BlockManager
from megakernel.kv.cache import KVCache, KVLayout
from megakernel.model.cohere2_moe import Cohere2MoeModel, ForwardBatch
from megakernel.model.weights import random_weights
from tiny_models import VARIANTS, config_kwargs, prefill_ragged  # noqa: F401 (VARIANTS re-exported)


ROOT = Path(__file__).resolve().parents[1]


def run_in_fresh_interpreter(code: str, env: dict[str, str], cache_dir: Path | None = None) -> str:
    """Runs `code` (dedented) in a new Python with `env` added, for the experiments opcodes.py reads at import
    (MEGAKERNEL_BLOCKS_PER_SM, MEGAKERNEL_ATTN_MAX_STAGES); the repository and the test folders on its path, and
    cache_dir as the kernel's build cache when given. Fails with the child's output tail; returns its stdout."""
    full = {**os.environ, **env,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "kernel"),
                                           os.environ.get("PYTHONPATH", "")])}
    if cache_dir is not None:
        full["MEGAKERNEL_CACHE_DIR"] = str(cache_dir)
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def make_cfg(name: str) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": "cohere2_moe", **config_kwargs(name)})


def tiny_weights(cfg: ModelConfig, device="cpu", dtype=torch.float32, seed=0, scale=2.0):
    """Random weights scaled up so attention and routing are far from uniform."""
    w = random_weights(cfg, device=device, dtype=torch.float32, seed=seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    for t in w.tensors():
        if t.dim() >= 2:
            t.mul_(scale)
        else:
            t.add_(torch.randn(t.shape, generator=g, device=device) * 0.05)
    return w.to(dtype=dtype)


@dataclass
class State:
    cfg: ModelConfig
    weights: object
    layout: KVLayout
    cache: KVCache
    blocks: BlockManager
    seqs: list
    tokens: list[list[int]]          # every sequence's tokens so far (prompt + generated)


def prefill_state(cfg, weights, lens, block_size=4, n_blocks=512, seed=0, device="cpu", chunk=7) -> State:
    """Prefill ragged prompts of `lens` tokens with the PyTorch path (chunked, ragged batch)."""
    layout = KVLayout.for_model(cfg, block_size)
    nb = [n_blocks] * len(layout.groups)
    cache = KVCache(layout, nb, device, weights.dtype)
    blocks = BlockManager(layout, nb)
    model = Cohere2MoeModel(cfg, weights)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    seqs, _ = prefill_ragged(model, cache, blocks, prompts, chunk, device)
    return State(cfg, weights, layout, cache, blocks, seqs, [list(p) for p in prompts])


def decode_batch(st: State, next_ids: list[int], device="cpu") -> ForwardBatch:
    """Allocate the next position of every sequence and build the one-token-per-sequence batch."""
    ids, pos, starts, tables = [], [], [0], []
    for i, seq in enumerate(st.seqs):
        p = len(st.tokens[i])
        st.blocks.prepare(seq, p, p + 1)
        ids.append(next_ids[i])
        pos.append(p)
        starts.append(len(ids))
        tables.append(seq.tables)
    return ForwardBatch(torch.tensor(ids, device=device), torch.tensor(pos, device=device), starts, tables)


def clone_cache(cache: KVCache) -> KVCache:
    c = copy.copy(cache)
    c.kv = [t.clone() for t in cache.kv]
    return c


# ---- megakernel test hooks -----------------------------------------------------------------------------------------
# They wrap two private steps of MegakernelBackend._launch on one backend object: `_task_list(si)` (the step's task
# records) and `_params(si, tl, tasks, kv, cache, logits, n_step)` (built right before the launch, once that
# launch's buffers exist).

def poison_scratch(be) -> None:
    """Fill `be`'s scratch, attention partials and logits with NaN (0xFF bytes) before every launch, so a step
    that reads anything it did not write first shows NaN."""
    params = be._params

    def poisoned(si, tl, tasks, kv, cache, logits, n_step, *rest):
        be.scratch_bytes.fill_(0xFF)
        be.part_o.fill_(float("nan"))
        be.part_lse.fill_(float("nan"))
        logits.fill_(float("nan"))
        return params(si, tl, tasks, kv, cache, logits, n_step, *rest)

    be._params = poisoned


def hang_launches(be, which: Callable[[int], bool]) -> None:
    """Make `be`'s n-th launch (counting from 1) hang wherever which(n): one task of its list waits for one more
    arrival than its counter ever gets, so the in-kernel watchdog ends the step."""
    from megakernel.kernel import opcodes as O
    from megakernel.transfer import to_device

    task_list, launches = be._task_list, [0]

    def maybe_hung(si):
        tl, tasks = task_list(si)
        launches[0] += 1
        if not which(launches[0]):
            return tl, tasks
        rec = tl.records.copy()
        i = len(rec) // 2
        while int(rec[i, O.R["w0c"]]) < 0:
            i += 1
        rec[i, O.R["w0t"]] += 1
        return tl, to_device(torch.from_numpy(rec), torch.int32, be.device)

    be._task_list = maybe_hung


def tiny_decode_setup(variant: str, B: int, device: str = "cuda"):
    """The tiny decode tests' starting point: config, bf16 weights, B ragged prompts (1..29 tokens) prefilled by
    the PyTorch path, that path's exact model (the oracle: no Triton prefill, experts looped as on CPU), and the
    generator the test goes on drawing from."""
    cfg = make_cfg(variant)
    w = tiny_weights(cfg, device=device, dtype=torch.bfloat16, seed=B, scale=1.0)
    g = torch.Generator().manual_seed(B)
    lens = torch.randint(1, 30, (B,), generator=g).tolist()
    st = prefill_state(cfg, w, lens, device=device, seed=B)
    return cfg, w, st, Cohere2MoeModel(cfg, w, fast_prefill=False), g


def emulated_trace(n_blocks: int = 8):
    """A profiled step's raw records emulated on CPU from a real task list (north_like tiny model, 3 rows): the
    RawProfile, its Timeline and the TaskList (the timeline tools' tests; no GPU)."""
    from megakernel.kernel import timeline as T
    from megakernel.kernel.plan import ModelPlan
    from megakernel.kernel.schedule import build_tasks, step_inputs

    cfg = make_cfg("north_like")
    w = tiny_weights(cfg)
    st = prefill_state(cfg, w, [13, 30, 5], chunk=16)
    batch = decode_batch(st, [5, 6, 7])
    plan = ModelPlan(cfg, st.layout, max_batch=16, n_workers=n_blocks, split_tokens=8)
    si = step_inputs(plan, batch.input_ids.tolist(), batch.positions.tolist(), batch.block_tables)
    tl = build_tasks(plan, si.B, si.nsplit)
    nbytes, _ = T.task_bytes(plan, si, tl.records)
    raw = T.emulate(tl.records, nbytes, n_blocks=n_blocks)
    return raw, T.to_timeline(raw), tl

