"""`megakernel bench serve` (issue 13) on CPU: the workloads are seeded and as stated, the figures follow from the
request records, the engine idle share tiles the device's time, and the generator's counts agree with what the
server streamed and counted (a self-started server, then a time-bounded run against --base-url)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from server_harness import API_KEY, MODEL_NAME, REPO

from megakernel.bench_serve import LoadResult, RequestRecord, Workload, parse_bounds, summarize
from megakernel.errors import MegakernelError

ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megakernel", "bench", "serve", "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout, env=ENV, cwd=REPO)


# ---- workloads -------------------------------------------------------------------------------------------------
def test_named_workloads_have_the_issue_lengths():
    assert (Workload.parse("fixed").prompt, Workload.parse("fixed").output) == ((1024, 1024), (1024, 1024))
    assert (Workload.parse("long").prompt, Workload.parse("long").output) == ((32768, 32768), (256, 256))
    mix = Workload.parse("code-mix")
    assert (mix.prompt, mix.output) == ((1024, 16384), (128, 2048))
    assert mix.describe() == "prompt log-uniform over [1024, 16384] tokens, output log-uniform over [128, 2048] tokens"
    for bad in ("nope", "fixed:0:5", "mix:20-10:1-2"):
        with pytest.raises(MegakernelError):
            Workload.parse(bad)


def test_code_mix_lengths_are_log_uniform_and_seeded():
    mix = Workload.parse("code-mix")
    lens = np.array([mix.lengths(0, i) for i in range(4000)])
    p, o = lens[:, 0], lens[:, 1]
    assert p.min() >= 1024 and p.max() <= 16384 and o.min() >= 128 and o.max() <= 2048
    # log-uniform: the median is the geometric mean of the bounds, a quarter fall below 2x the lower bound
    assert abs(np.median(p) / 4096 - 1) < 0.08 and abs(np.median(o) / 512 - 1) < 0.08
    assert abs((p < 2048).mean() - 0.25) < 0.03 and abs((o < 256).mean() - 0.25) < 0.03
    assert abs(np.corrcoef(np.log(p), np.log(o))[0, 1]) < 0.05          # drawn independently
    assert [mix.lengths(0, i) for i in range(5)] == [mix.lengths(0, i) for i in range(5)]
    assert [mix.lengths(0, i) for i in range(5)] != [mix.lengths(1, i) for i in range(5)]


def test_requests_are_reproducible_and_never_share_a_prefix_across_runs():
    mix = Workload.parse("mix:64-512:8-32")
    a, b = mix.request(0, 8, 3, (16, 4000)), mix.request(0, 8, 3, (16, 4000))
    assert a == b and len(a.prompt) == mix.lengths(0, 3)[0] and a.max_tokens == mix.lengths(0, 3)[1]
    assert min(a.prompt) >= 16 and max(a.prompt) < 4000
    c = mix.request(0, 16, 3, (16, 4000))             # another concurrency: same lengths, other tokens
    assert (len(c.prompt), c.max_tokens) == (len(a.prompt), a.max_tokens) and c.prompt[:16] != a.prompt[:16]


def test_bounds_take_the_most_specific_override():
    look = parse_bounds("15,long=30,torch=10,torch/long=40,fixed@8=20,torch/fixed@8=6,@16=3", float)
    assert [look("graph", "fixed", 1), look("graph", "long", 1), look("torch", "fixed", 1), look("torch", "long", 1)] \
        == [15, 30, 10, 40]
    assert [look("graph", "fixed", 8), look("torch", "fixed", 8), look("graph", "long", 8), look("graph", "x", 16),
            look("graph", "long", 16)] == [20, 6, 30, 3, 30]
    with pytest.raises(MegakernelError):
        parse_bounds("long=30", float)
    with pytest.raises(MegakernelError):
        parse_bounds("15,long=x", float)


# ---- figures from records --------------------------------------------------------------------------------------
def test_summary_figures_follow_from_the_records():
    def rec(i, status, start, times, tokens, end=None, usage=None):
        r = RequestRecord(i, 100, 4, status=status, start=start, end=end)
        r.chunk_times, r.chunk_tokens, r.usage_completion_tokens = times, tokens, usage
        return r

    recs = [rec(0, "completed", 0.0, [0.5, 0.6, 0.8], [1, 1, 2], end=0.9, usage=4),
            rec(1, "completed", 1.0, [1.2, 1.3, 1.4, 1.5], [1, 1, 1, 1], end=1.6, usage=4),
            rec(2, "incomplete", 1.5, [1.9], [1]),            # cut at the limit after its first token
            rec(3, "incomplete", 1.9, [], []),                # cut before it
            rec(4, "failed", 0.1, [], [])]
    recs[4].error = "HTTP 500: boom"
    s = summarize(LoadResult(recs, 0.0, 2.0, "max_seconds"))
    assert (s["requests_sent"], s["requests_completed"], s["requests_incomplete"], s["requests_failed"]) == (5, 2, 2, 1)
    assert s["requests_without_first_token"] == 2 and s["errors"] == ["HTTP 500: boom"]
    assert s["output_tokens"] == 9 and s["output_tokens_per_s"] == pytest.approx(4.5)
    assert s["prompt_tokens"] == 300 and s["requests_per_s"] == pytest.approx(1.0)
    assert s["completed_output_tokens"] == 8 == s["usage_completion_tokens"] and s["token_counts_match"]
    assert s["ttft_p50_s"] == pytest.approx(0.4) and s["ttft_mean_s"] == pytest.approx((0.5 + 0.2 + 0.4) / 3)
    # ITL: 0.1 (one token), 0.2 split over two tokens, then 0.1 x3: one sample per token after the first chunk
    assert s["itl_samples"] == 6 and s["itl_p50_s"] == pytest.approx(0.1)
    assert s["tpot_p50_s"] == pytest.approx(((0.3 / 3) + (0.3 / 3)) / 2)
    assert s["e2e_p50_s"] == pytest.approx(0.75) and s["e2e_p99_s"] == pytest.approx(0.9 - 0.003, abs=1e-3)
    bad = recs[:2]
    bad[1].usage_completion_tokens = 3
    assert not summarize(LoadResult(bad, 0.0, 2.0, "num_requests"))["token_counts_match"]


# ---- the engine idle share -------------------------------------------------------------------------------------
class _FakeEngine:
    """Steps that take `busy` seconds inside _launch; `requests` says whether work is left."""

    device = None

    def __init__(self, busy: float) -> None:
        self.busy = busy
        self.requests = 1

    def _launch(self):
        time.sleep(self.busy)

    def step(self):
        self._launch()

    def abort_request(self, rid):
        self.requests = 0

    def has_unfinished_requests(self) -> bool:
        return self.requests > 0


def test_step_gap_meter_tiles_busy_stretches_and_skips_idle_ones():
    from prometheus_client import CollectorRegistry, generate_latest

    from megakernel.server.step_gaps import watch_step_gaps

    eng = _FakeEngine(busy=0.02)
    reg = CollectorRegistry()
    meter = watch_step_gaps(eng, reg)
    t0 = time.perf_counter()
    for _ in range(10):
        eng.step()
        time.sleep(0.01)                  # the host between steps: a gap
    eng.abort_request("x")                # the engine empties: the stretch ends here
    wall = time.perf_counter() - t0
    time.sleep(0.3)                       # no request: not counted
    eng.requests = 1
    for _ in range(3):
        eng.step()
    t = meter.totals()
    assert t["steps"] == 13
    assert t["busy_s"] == pytest.approx(13 * 0.02, rel=0.25)
    # the first stretch tiles its wall time (10 steps, 9 gaps between them); the second adds 2 short gaps
    assert t["gap_s"] == pytest.approx(9 * 0.01, rel=0.4)
    assert t["gap_s"] < 0.25 and abs(t["busy_s"] + t["gap_s"] - wall - 3 * 0.02) < 0.05
    text = generate_latest(reg).decode()
    assert f"megakernel_engine_steps_launched_total {13:.1f}" in text
    assert "megakernel_engine_step_gap_seconds_total" in text and "megakernel_engine_step_busy_seconds_total" in text


def test_step_gap_meter_leaves_other_engines_alone():
    from megakernel.server.step_gaps import watch_step_gaps

    class Scripted:
        def step(self):
            return []

    eng = Scripted()
    assert watch_step_gaps(eng) is None and "step" not in vars(eng)


# ---- end to end on the embedded model --------------------------------------------------------------------------
def test_bench_serve_against_a_self_started_server(tmp_path):
    """The generator starts `megakernel serve --backend torch` on the embedded model, runs two concurrencies to
    their request bound and stops the server; every count must agree with the server's."""
    out = tmp_path / "serve.json"
    P, O, N = 48, 12, 6
    p = _bench("--backend", "torch", "--workloads", f"fixed:{P}:{O}", "--concurrency", "1,3", "--num-requests",
               str(N), "--max-seconds", "120", "--server-args", "--kv-cache-memory 64M --block-size 16",
               "--json", str(out), "--plot", str(tmp_path / "serve.png"), "--markdown", str(tmp_path / "serve.md"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {"commit", "date", "gpu", "command", "records", "workloads"} <= doc.keys()
    assert doc["gpu"] == "cpu" and doc["command"].startswith("megakernel bench serve --no-progress --backend torch")
    assert [r["concurrency"] for r in doc["records"]] == [1, 3]
    for r in doc["records"]:
        assert {"backend", "workload", "concurrency", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
                "itl_p99_s", "gpu_idle_share"} <= r.keys()
        assert r["backend"] == "torch" and r["workload"] == f"fixed:{P}:{O}" and r["stopped_by"] == "num_requests"
        assert r["requests_sent"] == r["requests_completed"] + r["requests_failed"] + r["requests_incomplete"]
        assert (r["requests_sent"], r["requests_completed"], r["requests_failed"]) == (N, N, 0), r["errors"]
        # tokens counted chunk by chunk = the final usage = the server's own count = N x O (ignore_eos)
        assert r["token_count_source"] == "per-chunk usage" and r["token_counts_match"]
        assert r["output_tokens"] == r["usage_completion_tokens"] == r["server_generation_tokens"] == N * O
        assert r["prompt_tokens"] == r["server_prompt_tokens"] == N * P and r["server_requests"] == N
        assert N * (O - 1) >= r["itl_samples"] >= N * (O - 1) - N      # a first chunk rarely holds two tokens
        for m in ("ttft", "itl", "e2e", "tpot"):
            assert 0 < r[f"{m}_p50_s"] <= r[f"{m}_p90_s"] <= r[f"{m}_p99_s"], m
        assert r["e2e_p50_s"] > r["ttft_p50_s"]
        assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["duration_s"])
        assert 0 <= r["gpu_idle_share"] < 0.5 and r["engine_steps"] >= O
    assert (tmp_path / "serve.png").stat().st_size > 10_000
    table = (tmp_path / "serve.md").read_text()
    assert table.count(f"| fixed:{P}:{O} |") == 2
    log = (tmp_path / "serve.server-torch.log").read_text()
    assert "decode backend torch" in log


def test_bench_serve_time_bound_against_base_url(server, tmp_path):
    """A run cut by --max-seconds against a running server: the cut requests are counted as incomplete, the server
    aborts them (it is idle right after), and it generated at least the tokens we received."""
    out = tmp_path / "t.json"
    t0 = time.monotonic()
    p = _bench("--base-url", server.url, "--api-key", API_KEY, "--backend", "label-x", "--workloads",
               "fixed:32:400", "--concurrency", "2", "--num-requests", "50", "--max-seconds", "2",
               "--warmup-requests", "0", "--json", str(out))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert time.monotonic() - t0 < 60 and "label-x fixed:32:400 c=2:" in p.stderr
    assert server.metric_of(server.wait_idle(timeout=5), "megakernel_num_requests_running") == 0
    r = json.loads(out.read_text())["records"][0]
    assert r["backend"] == "label-x" and r["stopped_by"] == "max_seconds"
    assert r["duration_s"] == pytest.approx(2.0)
    assert r["requests_sent"] == r["requests_completed"] + r["requests_failed"] + r["requests_incomplete"]
    assert r["requests_incomplete"] >= 1 and r["requests_failed"] == 0
    assert r["server_generation_tokens"] >= r["output_tokens"] > 0 and r["server_requests"] == r["requests_sent"]
    assert math.isfinite(r["ttft_p50_s"]) and r["gpu_idle_share"] is not None


def test_bench_serve_replays_a_request_list(server, tmp_path):
    """--prompts: text and token-id prompts, with and without max_tokens, replayed in order; prompt tokens are the
    server's count (text is tokenised there)."""
    items = ["def add(a, b):", {"prompt": "import os\nimport sys\n", "max_tokens": 5}, [17, 42, 99, 123],
             {"prompt": [5, 6, 7], "max_tokens": 3}]
    (tmp_path / "p.json").write_text(json.dumps(items))
    out = tmp_path / "r.json"
    before = server.metrics()
    p = _bench("--base-url", server.url, "--api-key", API_KEY, "--workloads", "fixed:8:9", "--concurrency", "1",
               "--num-requests", "8", "--prompts", str(tmp_path / "p.json"), "--warmup-requests", "0",
               "--json", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())["records"][0]
    assert r["requests_completed"] == 8 and r["output_tokens"] == 2 * (9 + 5 + 9 + 3) == r["completed_max_tokens"]
    server_prompt = server.metric_of(server.metrics(), "megakernel_prompt_tokens_total") - \
        server.metric_of(before, "megakernel_prompt_tokens_total")
    assert r["prompt_tokens"] == server_prompt and r["prompt_tokens"] > 2 * (4 + 3)
    (tmp_path / "bad.json").write_text(json.dumps([{"max_tokens": 3}]))
    p = _bench("--base-url", server.url, "--prompts", str(tmp_path / "bad.json"))
    assert p.returncode == 2 and "not a JSON list of prompts" in p.stderr


def test_per_chunk_usage_counts_the_tokens_of_each_chunk(server):
    """What the generator counts a chunk as (the rise of the chunk's cumulative usage) is the number of tokens the
    chunk holds: checked against the chunk's own token list (logprobs), with four streams at once so that chunks
    may carry several tokens."""
    import asyncio

    import httpx

    async def stream(i: int) -> list[tuple[int, int]]:
        body = {"model": MODEL_NAME, "prompt": list(range(20 + i, 60 + i)), "max_tokens": 60, "ignore_eos": True,
                "stream": True, "logprobs": 0, "stream_options": {"include_usage": True,
                                                                 "continuous_usage_stats": True}}
        pairs, seen = [], 0
        async with httpx.AsyncClient(timeout=120) as c:
            async with c.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        obj = json.loads(line[6:])
                        if obj["choices"]:
                            n = obj["usage"]["completion_tokens"] - seen
                            seen += n
                            pairs.append((n, len(obj["choices"][0]["logprobs"]["tokens"])))
        return pairs

    async def main():
        return await asyncio.gather(*(stream(i) for i in range(4)))

    streams = asyncio.run(main())
    for pairs in streams:
        assert sum(n for n, _ in pairs) == 60 and all(n == k for n, k in pairs), pairs
    print("tokens per chunk:", sorted({n for pairs in streams for n, _ in pairs}))


def test_bench_serve_errors_are_one_line():
    p = _bench("--workloads", "bogus")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "unknown workload 'bogus'" in p.stderr
    p = _bench("--num-requests", "long=3")
    assert p.returncode == 2 and "need a default" in p.stderr


def test_serve_random_north_needs_a_gpu():
    if __import__("torch").cuda.is_available():
        pytest.skip("a GPU is present")
    p = subprocess.run([sys.executable, "-m", "megakernel", "serve", "--random-north"], capture_output=True, text=True,
                       timeout=120, env=ENV, cwd=REPO)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: --random-north") and "CUDA GPU" in p.stderr
