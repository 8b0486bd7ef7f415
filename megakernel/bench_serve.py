"""`megakernel bench serve`: what a user of `megakernel serve` gets end to end, per decode backend.

An asyncio load generator over the OpenAI HTTP API (httpx, streaming `/v1/completions`), closed loop like vLLM's
`bench serve --max-concurrency`: a semaphore keeps `concurrency` requests in flight, each run is bounded by a
request count and a time limit. It drives a server it starts itself (`python -m megakernel serve --backend B`, one
per backend, with `--random-north` or `--model`) or one at `--base-url`.

Requests. Prompts are token-id lists of exact, seeded lengths (random weights have no tokenizer); `max_tokens` is
the output length and `ignore_eos: true` makes every answer full length. Streams ask for
`stream_options: {include_usage, continuous_usage_stats}`, so every chunk carries the server's cumulative
completion-token count: a chunk's tokens are the increase of that count (without per-chunk usage, one token per
chunk, vLLM's convention). The final usage chunk is checked against the tokens counted chunk by chunk.

Workloads (seeded: request i of a workload has the same lengths on every backend and concurrency; its prompt tokens
also depend on the concurrency, so runs on one server never share a cached prefix):
- fixed: 1024-token prompts, 1024-token outputs;
- code-mix: prompt length log-uniform over [1024, 16384], output length log-uniform over [128, 2048], drawn
  independently per request (L = round(exp(U(ln lo, ln hi))));
- long: 32768-token prompts, 256-token outputs.
`fixed:P:O` and `mix:P1-P2:O1-O2` give other lengths (the CPU tests use small ones). `--prompts FILE` replays
the requests of a JSON list instead (request i sends item i modulo their number): a prompt (text or token ids) or
{"prompt": ..., "max_tokens": N}, the workload giving the output length where an item has none. The cross-check
with aiperf replays aiperf's own requests that way.

Figures per run (a record in the JSON):
- requests/s: completed requests / duration; output tok/s: every token received in the run / duration (tokens of
  requests cut at the time limit count: they reached the user); prompt tok/s: prompt tokens of requests that got a
  first token / duration. Duration: until the last request ended, or the time limit.
- TTFT: first token's arrival - request sent, of every request that got one. ITL: the gap between two chunks,
  split evenly over the chunk's tokens (one sample per token after the first chunk). TPOT: (last token - first
  token) / (tokens - 1) per completed request. E2E: sent to [DONE], completed requests. Each at mean, p50, p90 and
  p99 (numpy's linear percentiles).
- gpu_idle_share: the engine idle share over the run, from the server's /metrics
  (`megakernel/server/step_gaps.py`): device time between one engine step's queued work and the next step's launch,
  over device time while requests were in the engine. A host-side-launched proxy for the GPU's idle time between
  decode steps (a lower bound: see that module); null for a server without those counters.
- Counts: requests sent = completed + failed + incomplete (incomplete: still running at the time limit, then
  cancelled), with the server's own /metrics deltas beside ours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np

from megakernel.errors import MegakernelError

log = logging.getLogger("megakernel.bench_serve")

WORKLOADS = {"fixed": "fixed:1024:1024", "code-mix": "mix:1024-16384:128-2048", "long": "fixed:32768:256"}
PERCENTILES = (50, 90, 99)
STEP_COUNTERS = {"busy_s": "megakernel_engine_step_busy_seconds_total",
                 "gap_s": "megakernel_engine_step_gap_seconds_total",
                 "steps": "megakernel_engine_steps_launched_total"}
SERVER_COUNTERS = {"requests": "megakernel_requests_total", "prompt_tokens": "megakernel_prompt_tokens_total",
                   "generation_tokens": "megakernel_generation_tokens_total"}
IDLE_SHARE_METHOD = ("engine idle share (megakernel/server/step_gaps.py): device time between one engine step's "
                     "queued work and the next step's launch / device time while requests were in the engine "
                     "(CUDA events on GPU); a lower bound on the GPU's idle time between steps")


# ---- workloads ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Prompt and output lengths: fixed, or log-uniform between bounds (`mix`)."""

    name: str
    spec: str
    prompt: tuple[int, int]
    output: tuple[int, int]

    @classmethod
    def parse(cls, text: str) -> "Workload":
        spec = WORKLOADS.get(text, text)
        m = re.fullmatch(r"fixed:(\d+):(\d+)", spec)
        if m:
            p, o = int(m.group(1)), int(m.group(2))
            w = cls(text, spec, (p, p), (o, o))
        else:
            m = re.fullmatch(r"mix:(\d+)-(\d+):(\d+)-(\d+)", spec)
            if not m:
                raise MegakernelError(f"unknown workload {text!r}: use {', '.join(WORKLOADS)}, fixed:P:O or "
                                      "mix:P1-P2:O1-O2")
            p1, p2, o1, o2 = map(int, m.groups())
            w = cls(text, spec, (p1, p2), (o1, o2))
        if min(w.prompt + w.output) < 1 or w.prompt[0] > w.prompt[1] or w.output[0] > w.output[1]:
            raise MegakernelError(f"workload {text!r}: lengths must be positive, low <= high")
        return w

    @property
    def max_len(self) -> int:
        """The longest prompt + output: the server's max_model_len must hold it."""
        return self.prompt[1] + self.output[1]

    def describe(self) -> str:
        def one(lo: int, hi: int) -> str:
            return str(lo) if lo == hi else f"log-uniform over [{lo}, {hi}]"

        return f"prompt {one(*self.prompt)} tokens, output {one(*self.output)} tokens"

    def lengths(self, seed: int, index: int) -> tuple[int, int]:
        """(prompt, output) lengths of request `index`: the same for every backend and concurrency."""
        rng = np.random.default_rng([seed, zlib.crc32(self.spec.encode()), index])
        return _log_uniform(rng, *self.prompt), _log_uniform(rng, *self.output)

    def request(self, seed: int, concurrency: int, index: int, token_ids: tuple[int, int]) -> "RequestSpec":
        p, o = self.lengths(seed, index)
        rng = np.random.default_rng([seed, zlib.crc32(self.spec.encode()), concurrency, index, 1])
        return RequestSpec(index, rng.integers(token_ids[0], token_ids[1], size=p).tolist(), o)


def _log_uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    if lo == hi:
        return lo
    return int(min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))))


@dataclass
class RequestSpec:
    index: int
    prompt: list[int] | str
    max_tokens: int


def replayed(items: list, workload: Workload, seed: int) -> Callable[[int], RequestSpec]:
    """Request i: item i (modulo their number) of a --prompts list; its max_tokens, else the workload's output
    length of request i."""
    def make(i: int) -> RequestSpec:
        item = items[i % len(items)]
        prompt, n = (item["prompt"], item.get("max_tokens")) if isinstance(item, dict) else (item, None)
        return RequestSpec(i, prompt, int(n) if n else workload.lengths(seed, i)[1])

    return make


def parse_bounds(text: str, kind: Callable[[str], float]) -> Callable[[str, str, int], float]:
    """`15` or `15,long=30,fixed@8=20,torch=10,torch/long=40`: a default plus overrides by workload, backend,
    backend/workload, each optionally @concurrency. Returns lookup(backend, workload, concurrency); the most
    specific key wins: backend/workload@c, backend/workload, workload@c, backend@c, workload, backend, @c, default."""
    table: dict[str, float] = {}
    for item in text.split(","):
        key, _, value = item.rpartition("=")
        try:
            table[key.strip()] = kind(value)
        except ValueError:
            raise MegakernelError(f"not a bound: {item!r} (e.g. 15, long=30, fixed@8=20 or torch/long=40)") from None
    if "" not in table:
        raise MegakernelError(f"bounds {text!r} need a default value (e.g. '15,long=30')")

    def lookup(backend: str, workload: str, concurrency: int = 0) -> float:
        c = f"@{concurrency}"
        for key in (f"{backend}/{workload}{c}", f"{backend}/{workload}", f"{workload}{c}", f"{backend}{c}", workload,
                    backend, c, ""):
            if key in table:
                return table[key]
        raise AssertionError

    return lookup


# ---- one run -----------------------------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int
    max_tokens: int
    status: str = "pending"              # completed | failed | incomplete (cut at the time limit)
    error: str | None = None
    start: float = 0.0
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    per_chunk_usage: bool = True          # False: a chunk without usage counted as one token

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def first_token(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None


@dataclass
class LoadResult:
    records: list[RequestRecord]
    t0: float
    t_end: float
    stopped_by: str                      # "num_requests" or "max_seconds"
    wall0: float = 0.0                   # time.time() at t0 (to line runs up with other tools' logs)


async def _send(client, url: str, model: str, spec: RequestSpec, rec: RequestRecord, headers: dict) -> None:
    """One streaming completion; fills `rec` (failures become status "failed", never exceptions)."""
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    rec.start = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec.status, rec.error = "failed", f"HTTP {r.status_code}: {text[:300]}"
                return
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    rec.status, rec.error = "failed", f"stream error: {json.dumps(obj['error'])[:300]}"
                    return
                usage = obj.get("usage")
                if usage is not None and usage.get("prompt_tokens") is not None:
                    rec.prompt_tokens = int(usage["prompt_tokens"])     # the server's count (text prompts)
                if obj.get("choices"):
                    if usage is not None:
                        n = int(usage["completion_tokens"]) - rec.tokens
                    else:
                        rec.per_chunk_usage = False
                        n = 1
                    if n > 0:
                        rec.chunk_times.append(now)
                        rec.chunk_tokens.append(n)
                elif usage is not None:              # the final usage chunk
                    rec.usage_completion_tokens = int(usage["completion_tokens"])
                    rec.usage_prompt_tokens = int(usage["prompt_tokens"])
        rec.end = time.perf_counter()
        rec.status = "completed" if done else "failed"
        if not done:
            rec.error = "the stream ended without [DONE]"
    except asyncio.CancelledError:
        rec.status = "incomplete"
        raise
    except Exception as e:  # noqa: BLE001 - a failed request is a figure, not a crash
        rec.end = time.perf_counter()
        rec.status, rec.error = "failed", f"{type(e).__name__}: {e}"[:300]


async def run_load(base_url: str, model: str, make_request: Callable[[int], RequestSpec], concurrency: int,
                   num_requests: int, max_seconds: float, headers: dict | None = None, desc: str = "",
                   progress: bool = True) -> LoadResult:
    """Send up to `num_requests` requests, `concurrency` at a time, for at most `max_seconds`; requests still
    running at the limit are cancelled (closing their streams aborts them on the server)."""
    import httpx
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=num_requests, desc=desc, unit="req", disable=not progress, dynamic_ncols=True,
               file=sys.stderr)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        t0, wall0 = time.perf_counter(), time.time()
        deadline = t0 + max_seconds

        async def one(spec: RequestSpec, rec: RequestRecord) -> None:
            try:
                await _send(client, base_url, model, spec, rec, headers or {})
            finally:
                sem.release()
                if rec.status != "incomplete":
                    bar.update(1)

        async def drive() -> None:
            for i in range(num_requests):
                await sem.acquire()
                if time.perf_counter() >= deadline:
                    sem.release()
                    break
                spec = make_request(i)
                rec = RequestRecord(i, len(spec.prompt) if isinstance(spec.prompt, list) else 0, spec.max_tokens)
                records.append(rec)
                tasks.append(asyncio.create_task(one(spec, rec)))
            await asyncio.gather(*tasks)

        async def ticker() -> None:
            while True:
                await asyncio.sleep(0.5)
                el = time.perf_counter() - t0
                tok = sum(r.tokens for r in records)
                bar.set_postfix_str(f"{tok} tok, {tok / max(el, 1e-9):.1f} tok/s, {el:.0f}/{max_seconds:.0f} s")

        tick = asyncio.create_task(ticker())
        driver = asyncio.create_task(drive())
        try:
            done, _ = await asyncio.wait({driver}, timeout=max(0.0, deadline - time.perf_counter()))
            if done:
                driver.result()
                ends = [r.end for r in records if r.end is not None]
                t_end, stopped = (max(ends) if ends else time.perf_counter()), "num_requests"
            else:
                t_end, stopped = deadline, "max_seconds"
        finally:
            for t in (driver, *tasks, tick):
                t.cancel()
            await asyncio.gather(driver, *tasks, tick, return_exceptions=True)
            bar.close()
    for r in records:
        if r.status == "pending":            # cancelled at the limit before it started
            r.status = "incomplete"
    return LoadResult(records, t0, t_end, stopped, wall0)


def _stats(name: str, values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"{name}_mean_s": float(np.mean(values)) if values else None}
    pct = np.percentile(values, PERCENTILES) if values else [None] * len(PERCENTILES)
    for p, v in zip(PERCENTILES, pct):
        out[f"{name}_p{p}_s"] = float(v) if v is not None else None
    return out


def summarize(res: LoadResult) -> dict[str, Any]:
    """Every figure of one run from its request records (see the module docstring for the definitions)."""
    recs = res.records
    by = {s: [r for r in recs if r.status == s] for s in ("completed", "failed", "incomplete")}
    dur = max(res.t_end - res.t0, 1e-9)
    out_tokens = sum(r.tokens for r in recs)
    prefilled = [r for r in recs if r.first_token is not None]
    itl: list[float] = []
    for r in recs:
        for i in range(1, len(r.chunk_times)):
            k = r.chunk_tokens[i]
            itl.extend([(r.chunk_times[i] - r.chunk_times[i - 1]) / k] * k)
    tpot = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.tokens - 1) for r in by["completed"] if r.tokens > 1]
    errors = sorted({r.error for r in by["failed"] if r.error})[:3]
    completed_tokens = sum(r.tokens for r in by["completed"])
    usage = [r.usage_completion_tokens for r in by["completed"]]
    rec: dict[str, Any] = {
        "stopped_by": res.stopped_by, "duration_s": dur, "started_at_unix": res.wall0,
        "ended_at_unix": res.wall0 + dur,
        "requests_sent": len(recs), "requests_completed": len(by["completed"]), "requests_failed": len(by["failed"]),
        "requests_incomplete": len(by["incomplete"]),
        "requests_without_first_token": len(recs) - len(prefilled),
        "requests_per_s": len(by["completed"]) / dur,
        "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / dur,
        "prompt_tokens": sum(r.prompt_tokens for r in prefilled),
        "prompt_tokens_per_s": sum(r.prompt_tokens for r in prefilled) / dur,
        "completed_output_tokens": completed_tokens,
        "completed_max_tokens": sum(r.max_tokens for r in by["completed"]),
        "usage_completion_tokens": sum(u for u in usage if u is not None) if all(u is not None for u in usage)
        else None,
        "token_count_source": "per-chunk usage" if all(r.per_chunk_usage for r in recs) else "chunks",
    }
    rec["token_counts_match"] = rec["usage_completion_tokens"] == completed_tokens
    rec.update(_stats("ttft", [r.first_token - r.start for r in prefilled]))
    rec.update(_stats("itl", itl))
    rec.update(_stats("tpot", tpot))
    rec.update(_stats("e2e", [r.end - r.start for r in by["completed"]]))
    rec["itl_samples"] = len(itl)
    rec["errors"] = errors
    return rec


# ---- the server ------------------------------------------------------------------------------------------------
def scrape_metrics(base_url: str, headers: dict | None = None) -> dict[str, float] | None:
    """The server's /metrics as {name: value summed over label sets}; None if it has none."""
    import httpx

    try:
        r = httpx.get(base_url + "/metrics", timeout=10, headers=headers or {})
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m and not line.startswith("#"):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def wait_idle(base_url: str, timeout: float = 120.0, headers: dict | None = None) -> dict[str, float] | None:
    """Wait until the server has no running or waiting request (as its /metrics say) and return the metrics."""
    t0 = time.monotonic()
    while True:
        m = scrape_metrics(base_url, headers)
        gauges = ("megakernel_num_requests_running", "megakernel_num_requests_waiting")
        if m is None or not all(g in m for g in gauges) or sum(m[g] for g in gauges) == 0 \
                or time.monotonic() - t0 > timeout:
            return m
        time.sleep(0.25)


def _deltas(before: dict | None, after: dict | None, names: dict[str, str]) -> dict[str, float | None]:
    """after - before of each counter (a labelled counter appears with its first count: absent before is 0)."""
    return {k: after[v] - before.get(v, 0.0) if before is not None and after is not None and v in after else None
            for k, v in names.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m megakernel serve` on a free local port, for the duration of a `with` block."""

    def __init__(self, serve_args: list[str], log_path: Path, startup_timeout: float = 900.0) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "megakernel", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                    *serve_args]
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        log.info("starting %s (log: %s)", shlex.join(self.cmd), self.log_path)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.startup_timeout:
            if self.proc.poll() is not None:
                raise MegakernelError(f"the server exited with {self.proc.returncode} while starting: "
                                      f"{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    log.info("server up in %.1f s", time.monotonic() - t0)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise MegakernelError(f"the server did not answer /health within {self.startup_timeout:.0f} s: "
                              f"{self.tail()}")

    def tail(self, n: int = 15) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-n:])

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def served_model(base_url: str, headers: dict | None = None) -> str:
    import httpx

    try:
        r = httpx.get(base_url + "/v1/models", timeout=30, headers=headers or {})
    except httpx.HTTPError as e:
        raise MegakernelError(f"{base_url}/v1/models: {e}") from None
    if r.status_code != 200:
        raise MegakernelError(f"{base_url}/v1/models answered {r.status_code}: {r.text[:200]}")
    return r.json()["data"][0]["id"]


# ---- the benchmark -----------------------------------------------------------------------------------------------
def gpu_name() -> str:
    """The local GPU's name (nvidia-smi, so this process never touches CUDA), or "cpu"."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        names = [s.strip() for s in out.stdout.splitlines() if s.strip()]
        return names[0] if out.returncode == 0 and names else "cpu"
    except (OSError, subprocess.SubprocessError):
        return "cpu"


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


def _id_range(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+):(\d+)", text)
    if not m or int(m.group(1)) >= int(m.group(2)):
        raise argparse.ArgumentTypeError(f"not a token id range LO:HI: {text!r}")
    return int(m.group(1)), int(m.group(2))


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megakernel bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default=None, help="benchmark this server (e.g. http://127.0.0.1:8000) instead of "
                   "starting one")
    p.add_argument("--backends", default=None, help="comma-separated: start one server per decode backend, e.g. "
                   "megakernel,graph,torch (default: --backend)")
    p.add_argument("--backend", default="auto", help="the backend to start (or, with --base-url, its label)")
    p.add_argument("--model", default=None, help="checkpoint folder of the started server (default: embedded)")
    p.add_argument("--random-north", action="store_true", help="the started server serves North Mini Code with "
                   "random weights (GPU)")
    p.add_argument("--workloads", default="fixed", help=f"comma-separated: {', '.join(WORKLOADS)}, fixed:P:O, "
                   "mix:P1-P2:O1-O2")
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 16], help="requests in flight, comma-separated")
    p.add_argument("--num-requests", default="64", help="requests per run at most: N, or a default and overrides "
                   "KEY=N with KEY = WORKLOAD, BACKEND or BACKEND/WORKLOAD, each optionally @CONCURRENCY, e.g. "
                   "'64,long=8,fixed@16=32,torch/long@1=2'")
    p.add_argument("--max-seconds", default="120", help="seconds per run at most (same syntax as --num-requests)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every --max-seconds bound")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-ids", type=_id_range, default=(16, 4000), help="prompt token ids are drawn from LO:HI")
    p.add_argument("--prompts", default=None, help="replay a JSON list of requests instead of random token ids: "
                   "prompts (text or token ids) or {\"prompt\": ..., \"max_tokens\": N} (else the workload's output "
                   "length)")
    p.add_argument("--warmup-requests", type=int, default=2, help="short requests per server before the runs "
                   "(not counted)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="started server: prefill chunk size")
    p.add_argument("--max-model-len", type=int, default=None, help="started server (default: the longest "
                   "workload's prompt + output)")
    p.add_argument("--server-args", default="", help="more `megakernel serve` flags for the started server, e.g. "
                   "'--kv-cache-memory 64M'")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a started server may take")
    p.add_argument("--api-key", default=os.environ.get("MEGAKERNEL_API_KEY"), help="bearer token for /v1")
    p.add_argument("--gpu", default=None, help="the GPU named in the results (default: nvidia-smi's, or cpu)")
    p.add_argument("--json", default=None, help="write every figure here (rewritten after each run)")
    p.add_argument("--plot", default=None, help="with --json: draw throughput and latency to this PNG")
    p.add_argument("--markdown", default=None, help="write the results table (markdown) here")
    p.add_argument("--server-log-dir", default=None, help="started servers' logs (default: beside --json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-level", default="info")
    return p


def _serve_args(args: argparse.Namespace, backend: str, max_len: int, max_seqs: int) -> list[str]:
    out = ["--backend", backend, "--max-model-len", str(max_len), "--max-num-seqs", str(max_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--log-level", "info"]
    if args.random_north:
        out.append("--random-north")
    if args.model:
        out += ["--model", args.model]
    if args.api_key:
        out += ["--api-key", args.api_key]
    return out + shlex.split(args.server_args)


def bench_server(url: str, backend: str, workloads: list[Workload], args: argparse.Namespace,
                 num_requests: Callable[[str, str, int], float], max_seconds: Callable[[str, str, int], float],
                 on_record: Callable[[dict], None]) -> None:
    """Every (workload, concurrency) run against one server, each reported through on_record."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = served_model(url, headers)
    if args.warmup_requests > 0:
        warm = Workload.parse("fixed:64:8")
        asyncio.run(run_load(url, model, lambda i: warm.request(args.seed + 1, 0, i, args.token_ids), 2,
                             args.warmup_requests, 600.0, headers, desc=f"{backend} warm-up",
                             progress=not args.no_progress))
        wait_idle(url, headers=headers)
    prompts = args.prompt_items
    for w in workloads:
        for c in args.concurrency:
            n = int(num_requests(backend, w.name, c))
            secs = float(max_seconds(backend, w.name, c)) * args.time_scale
            make = replayed(prompts, w, args.seed) if prompts else \
                (lambda i, w=w, c=c: w.request(args.seed, c, i, args.token_ids))
            before = wait_idle(url, headers=headers)
            res = asyncio.run(run_load(url, model, make, c, n, secs, headers, desc=f"{backend} {w.name} c={c}",
                                       progress=not args.no_progress))
            after = wait_idle(url, headers=headers)
            rec = {"backend": backend, "workload": w.name, "workload_spec": w.spec, "concurrency": c,
                   "num_requests_bound": n, "max_seconds_bound": secs, **summarize(res)}
            steps = _deltas(before, after, STEP_COUNTERS)
            total = (steps["busy_s"] or 0.0) + (steps["gap_s"] or 0.0)
            rec["gpu_idle_share"] = steps["gap_s"] / total if steps["gap_s"] is not None and total > 0 else None
            rec.update({f"engine_{k}": v for k, v in steps.items()})
            rec.update({f"server_{k}": v for k, v in _deltas(before, after, SERVER_COUNTERS).items()})
            on_record(rec)
            log.info("%s", one_line(rec))


def _read_prompts(path: str) -> list:
    try:
        prompts = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise MegakernelError(f"--prompts {path}: {e}") from None
    def ok(p) -> bool:
        if isinstance(p, dict):
            return ok(p.get("prompt")) and isinstance(p.get("max_tokens", 1), int)
        return isinstance(p, str) or (isinstance(p, list) and bool(p) and all(isinstance(t, int) for t in p))

    if not isinstance(prompts, list) or not prompts or not all(ok(p) for p in prompts):
        raise MegakernelError(f"--prompts {path}: not a JSON list of prompts (text, token-id lists or "
                              "{\"prompt\": ..., \"max_tokens\": N})")
    return prompts


def one_line(r: dict) -> str:
    def f(v: float | None, scale: float = 1.0, fmt: str = ".3f") -> str:
        return "-" if v is None else format(v * scale, fmt)

    idle = "-" if r.get("gpu_idle_share") is None else f"{100 * r['gpu_idle_share']:.1f}%"
    return (f"{r['backend']} {r['workload']} c={r['concurrency']}: {r['requests_completed']}/{r['requests_sent']} "
            f"completed ({r['requests_failed']} failed, {r['requests_incomplete']} cut at the limit) in "
            f"{r['duration_s']:.1f} s; {r['output_tokens_per_s']:.1f} output tok/s, {r['prompt_tokens_per_s']:.0f} "
            f"prompt tok/s; TTFT p50 {f(r['ttft_p50_s'])} s p99 {f(r['ttft_p99_s'])} s; ITL p50 "
            f"{f(r['itl_p50_s'], 1e3, '.1f')} ms p99 {f(r['itl_p99_s'], 1e3, '.1f')} ms; engine idle {idle}")


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    from megakernel.bench import _git_commit

    workloads = [Workload.parse(w.strip()) for w in args.workloads.split(",") if w.strip()]
    if not workloads or not args.concurrency or min(args.concurrency) < 1:
        raise MegakernelError("give at least one workload and concurrencies of at least 1")
    num_requests = parse_bounds(args.num_requests, int)
    max_seconds = parse_bounds(args.max_seconds, float)
    backends = [b.strip() for b in (args.backends or args.backend).split(",") if b.strip()]
    args.prompt_items = _read_prompts(args.prompts) if args.prompts else None
    doc: dict[str, Any] = {
        "commit": _git_commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": args.gpu or gpu_name(), "command": "megakernel bench serve " + shlex.join(argv),
        "target": args.base_url or ("random North Mini Code" if args.random_north else args.model or "embedded"),
        "workloads": {w.name: {"spec": w.spec, "lengths": w.describe() + (f"; prompts from {args.prompts}" if
                                                                         args.prompts else "")} for w in workloads},
        "settings": {"concurrency": args.concurrency, "num_requests": args.num_requests,
                     "max_seconds": args.max_seconds, "time_scale": args.time_scale, "seed": args.seed, "token_ids": list(args.token_ids),
                     "max_num_batched_tokens": None if args.base_url else args.max_num_batched_tokens,
                     "ignore_eos": True, "temperature": 0.0, "endpoint": "/v1/completions (streaming)"},
        "gpu_idle_share_method": IDLE_SHARE_METHOD,
        "records": [],
    }

    def on_record(rec: dict) -> None:
        doc["records"].append(rec)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")

    if args.base_url:
        bench_server(args.base_url.rstrip("/"), backends[0], workloads, args, num_requests, max_seconds, on_record)
    else:
        max_len = args.max_model_len or max(w.max_len for w in workloads)
        log_dir = Path(args.server_log_dir or (Path(args.json).parent if args.json else tempfile.mkdtemp()))
        stem = Path(args.json).stem if args.json else "bench_serve"
        for b in backends:
            serve = _serve_args(args, b, max_len, max(args.concurrency))
            with ServerProcess(serve, log_dir / f"{stem}.server-{b}.log", args.startup_timeout) as server:
                bench_server(server.url, b, workloads, args, num_requests, max_seconds, on_record)
    return doc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), format="%(message)s")
    log.setLevel(getattr(logging, args.log_level.upper(), logging.INFO))
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise MegakernelError("bench serve needs httpx: pip install 'megakernel[bench]'") from None
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so a started server is stopped too
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    doc = run(args, argv)
    from megakernel.bench_serve_report import markdown_table, plot_serve

    table = markdown_table(doc)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        print(f"wrote {args.json}")
        if args.plot:
            plot_serve(doc, args.plot)
            print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
