"""Host time per engine step, with the model stubbed out: what the engine itself costs per decode step.

16 sequences with prompts of 1K, 32K and 256K tokens are prefilled and then decoded through `LLMEngine.step()`
(scheduling, block tables and window recycling, the prefix cache, `build_batch`, sampling, the bookkeeping of
pipelined tokens, incremental detokenization, the per-step snapshot). The model is a stub: its "forward" and its
decode backend hand back fp32 logits of the right shape and compute nothing, so the time measured is host work
only. Host work should grow with what is new in a step (one token per sequence), not with the context: the target
is per-step time flat within 2x from 1K to 256K.

Two more measurements cover what grows with the output rather than the prompt: decode steps once 16 outputs
have reached 1K and 32K tokens, and the server's work per streamed chat delta (special tokens stripped, the North
parser's pure-Python fallback) once a reply's text has reached 1K, 32K and 256K characters.

The sampler runs for real (on CPU tensors): the vocabulary is north-nano's 4096, so its share is small and the same
at every context length. Detokenization uses north-nano's tokenizer. Timings are with one torch thread.

    python benchmarks/host_step.py [--contexts 1024,32768,262144] [--outputs 1024,32768] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from megakernel.config import ModelConfig
from megakernel.default_model import EMBEDDED
from megakernel.engine.llm_engine import EngineArgs, LLMEngine
from megakernel.engine.loader import load_tokenizer
from megakernel.engine.sampling_params import SamplingParams
from megakernel.kv.cache import KVLayout
from megakernel.model.decode_backend import DecodeBackend, no_check
from megakernel.model.weights import random_weights

WINDOW = 4096      # North Mini Code's sliding window: sliding blocks are recycled as in the real model
BLOCK = 64


def stub_config(max_len: int) -> ModelConfig:
    """A North-shaped layer pattern (3 sliding : 1 full) with tiny dimensions, so the KV pool of 16 x 256K tokens
    is a few hundred MB (the stub never reads it, but block tables and recycling are real)."""
    return ModelConfig.from_dict({
        "model_type": "cohere2_moe", "vocab_size": 4096, "hidden_size": 8, "head_dim": 8, "num_attention_heads": 1,
        "num_key_value_heads": 1, "num_hidden_layers": 4, "intermediate_size": 8, "num_experts": 2,
        "num_experts_per_tok": 1, "sliding_window": WINDOW, "max_position_embeddings": max_len,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "bos_token_id": 1, "eos_token_id": 4,
    })


class StubModel:
    """Stands in for the model's forward: fp32 logits [rows, vocab] from a fixed table, no math."""

    def __init__(self, device: torch.device, vocab: int) -> None:
        self.device = device
        self.table = torch.randn(61, vocab, generator=torch.Generator().manual_seed(0))

    def forward(self, batch, cache, trace=None) -> torch.Tensor:
        n = batch.logits_rows.numel() if batch.logits_rows is not None else batch.num_seqs
        start = batch.host_positions()[-1] % 61
        idx = torch.arange(start, start + n) % 61          # a different token per step and row
        return self.table[idx]


class StubDecodeBackend(DecodeBackend):
    """A decode backend that runs apart from prefill (as the GPU backends do) and returns the stub's logits."""

    name = "stub"
    runs_with_prefill = False

    def __init__(self, model: StubModel) -> None:
        self.model = model

    def decode_async(self, batch, cache, trace=None):
        return self.model.forward(batch, cache), no_check


CHUNK = 65536      # prefill budget per step: 16 x 256K tokens of prompt in 64 steps


def build_engine(batch: int, max_len: int) -> LLMEngine:
    cfg = stub_config(max_len)
    layout = KVLayout.for_model(cfg, BLOCK)
    # room for every sequence at max_len in both pools, so nothing is preempted or ends for lack of KV blocks
    blocks = [batch * layout.blocks_per_seq(g, max_len, CHUNK) + 16 for g in range(len(layout.groups))]
    args = EngineArgs(device="cpu", dtype="bfloat16", max_num_seqs=batch, max_model_len=max_len,
                      max_num_batched_tokens=CHUNK, block_size=BLOCK, num_kv_blocks=blocks, progress=False)
    engine = LLMEngine(args, config=cfg, weights=random_weights(cfg, "cpu", torch.bfloat16),
                       tokenizer=load_tokenizer(EMBEDDED))
    stub = StubModel(engine.device, cfg.vocab_size)
    engine.runner.model = stub
    engine.runner.decode_backend = StubDecodeBackend(stub)
    return engine


def _stats(times: list[float]) -> dict:
    ms = sorted(x * 1e3 for x in times)
    return {"ms_per_step_median": round(statistics.median(ms), 4), "ms_per_step_mean": round(statistics.fmean(ms), 4),
            "ms_per_step_p90": round(ms[int(0.9 * len(ms))], 4), "ms_per_step_min": round(ms[0], 4)}


def _timed_steps(engine: LLMEngine, steps: int, batch: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        assert len(outs) == batch, "every sequence advances every decode step"
    return times


def _add_requests(engine: LLMEngine, batch: int, prompt_len: int) -> None:
    g = torch.Generator().manual_seed(prompt_len)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)     # until max_model_len
    for i in range(batch):
        # random prompts (no prefix-cache hits), drawn above the special tokens
        engine.add_request(f"r{i}", torch.randint(20, 4096, (prompt_len,), generator=g).tolist(), params)


def _prefill(engine: LLMEngine) -> int:
    """Step until every sequence has its first token; returns the number of steps."""
    n = 0
    sched = engine.scheduler
    while any(not s.output_token_ids for s in sched.running + list(sched.waiting)):
        engine.step()
        n += 1
    return n


def run_point(batch: int, context: int, steps: int, warmup: int = 8) -> dict:
    """Decode steps of `batch` sequences whose prompts have `context` tokens."""
    # the first sequences decode while the last ones still prefill: leave them room to keep going
    engine = build_engine(batch, context + steps + warmup + 1024)
    _add_requests(engine, batch, context)
    t0 = time.perf_counter()
    prefill_steps = _prefill(engine)
    prefill_s = time.perf_counter() - t0
    _timed_steps(engine, warmup, batch)
    times = _timed_steps(engine, steps, batch)
    return {"batch": batch, "context": context, "steps": steps, "prefill_steps": prefill_steps,
            "prefill_s": round(prefill_s, 2), **_stats(times)}


def run_output_points(batch: int, outputs: list[int], steps: int, prompt_len: int = 1024) -> list[dict]:
    """Decode steps once the outputs have grown to each of `outputs` tokens (what grows with the output: the
    per-step snapshot, detokenization, stop checks)."""
    engine = build_engine(batch, prompt_len + max(outputs) + steps + 64)
    _add_requests(engine, batch, prompt_len)
    _prefill(engine)
    points, done = [], 1
    for n_out in sorted(outputs):
        while done < n_out:
            engine.step()
            done += 1
        times = _timed_steps(engine, steps, batch)
        done += steps
        points.append({"batch": batch, "prompt": prompt_len, "output": n_out, "steps": steps, **_stats(times)})
    return points


def _stream_tracker():
    """The server's per-choice stream state (its home moved with the split of server/app.py)."""
    try:
        from megakernel.server.streaming import Tracker
    except ImportError:
        from megakernel.server.app import _Tracker as Tracker
    return Tracker


def run_server_points(chars: list[int], deltas: int = 256) -> list[dict]:
    """The server's host work per streamed delta of a chat choice whose text has grown to `chars` characters: the
    text delta with special tokens stripped and the North-format parser (its pure-Python fallback, which runs
    when cohere-melody is not installed). One delta per engine step, a token's worth of text each."""
    from megakernel.north_format import ChatParser
    from megakernel.engine.outputs import CompletionOutput

    tracker_cls = _stream_tracker()
    specials = ["<|END_OF_TURN_TOKEN|>", "<|START_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|USER_TOKEN|>",
                "<|SYSTEM_TOKEN|>", "<EOS_TOKEN>", "<BOS_TOKEN>", "<PAD>"]
    piece = "def f(x):\n    return x + 1  # "
    points = []
    for n in chars:
        text = "<|START_THINKING|>plan" + (piece * (n // len(piece) + 1))[:n] + "<|END_THINKING|><|START_TEXT|>"
        tracker, parser = tracker_cls(0, specials), ChatParser(False, True, use_melody=False)
        parser.feed(tracker.text_delta(CompletionOutput(0, [], text, None), False))     # the text so far
        times = []
        for i in range(deltas):
            text += " tok" + str(i)
            t = time.perf_counter()
            parser.feed(tracker.text_delta(CompletionOutput(0, [], text, None), False))
            times.append(time.perf_counter() - t)
        points.append({"chars": n, "deltas": deltas, **_stats(times)})
    return points


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,32768,262144", help="prompt lengths, comma-separated")
    ap.add_argument("--outputs", default="1024,32768", help="output lengths to time steps at (1K prompts); '' skips")
    ap.add_argument("--server-chars", default="1024,32768,262144",
                    help="streamed chat text lengths to time the server's per-delta work at; '' skips")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per point")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier timings)")
    ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. before / after)")
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    doc: dict = {"label": args.label, "commit": _commit(), "torch": torch.__version__,
                 "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                 "threads": args.threads}
    points = []
    for ctx in (int(c) for c in args.contexts.split(",") if c):
        p = run_point(args.batch, ctx, args.steps)
        points.append(p)
        print(f"batch {p['batch']}, prompt {ctx:>7}: {p['ms_per_step_median']:.3f} ms/step median "
              f"(p90 {p['ms_per_step_p90']:.3f}, min {p['ms_per_step_min']:.3f}); prefill {p['prefill_steps']} steps "
              f"in {p['prefill_s']:.1f} s", flush=True)
    doc["points"] = points
    if points:
        doc["ratio_largest_to_smallest"] = round(points[-1]["ms_per_step_median"] / points[0]["ms_per_step_median"],
                                                 3)
        print(f"largest / smallest prompt: {doc['ratio_largest_to_smallest']:.2f}x per step")
    if args.outputs:
        doc["output_points"] = run_output_points(args.batch, [int(c) for c in args.outputs.split(",")], args.steps)
        for p in doc["output_points"]:
            print(f"batch {p['batch']}, prompt {p['prompt']}, output {p['output']:>6}: {p['ms_per_step_median']:.3f} "
                  f"ms/step median (p90 {p['ms_per_step_p90']:.3f})", flush=True)
    if args.server_chars:
        doc["server_points"] = run_server_points([int(c) for c in args.server_chars.split(",")])
        for p in doc["server_points"]:
            print(f"server, one chat stream at {p['chars']:>7} chars: {p['ms_per_step_median']:.4f} ms per delta "
                  f"median (p90 {p['ms_per_step_p90']:.4f})", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
