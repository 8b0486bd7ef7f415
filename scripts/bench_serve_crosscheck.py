"""The body of scripts/bench_serve_crosscheck.sh: `megakernel bench serve` against aiperf (from the package index,
run unchanged), on the same workload and the same server (the embedded model on CPU, torch backend).

Two comparisons per concurrency:
- alone: each tool by itself, N requests: aiperf first, then ours replaying aiperf's own requests (text
  prompts and max_tokens from its inputs.json, through `bench serve --prompts`), so both send the same requests.
  Request, prompt-token and output-token counts must agree exactly; TTFT is reported with the server's own TTFT
  (its /metrics histogram) over each run, because on a small machine the load tool's own CPU use slows the server
  (aiperf runs ~10 processes), so the two runs do not see the same server.
- side by side: both tools at once for T seconds at the same concurrency, ours (in this process, already loaded)
  started when aiperf's first request reaches the server: both see the same server under the same load. Requests
  sent, output tokens and mean TTFT must agree within 10% (TTFT p50 and TPOT are reported beside them: in repeats of
  the same comparison the median moved by up to 16%, the mean by up to 6%, see the results file). aiperf lets
  its last requests finish after T (its grace period), ours cuts them: ours counts the tokens they had received.
$CROSSCHECK_TOLERANCE replaces the 10%. The server runs on CPU 0, the tools on CPU 1 (where the machine has two),
without prefix caching (ours replays prompts the server has seen). Writes
benchmarks/results/bench_serve_crosscheck_<date>.{json,md} (or $CROSSCHECK_RESULTS_DIR). Exit 1 on a mismatch.
Usage: python scripts/bench_serve_crosscheck.py [N, default 32] [PROMPT_TOKENS, default 512] [OUTPUT_TOKENS, 32]
                                               [T, seconds side by side, default 60]
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "server"))

from server_harness import MODEL_NAME, LiveServer  # noqa: E402

from megakernel.default_model import EMBEDDED  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 32
P = int(sys.argv[2]) if len(sys.argv) > 2 else 512
O = int(sys.argv[3]) if len(sys.argv) > 3 else 32  # noqa: E741
T = float(sys.argv[4]) if len(sys.argv) > 4 else 60.0
O_SD = O // 3          # output lengths vary (aiperf's normal spread): equal lengths lock the streams in phase
CONCURRENCY = tuple(int(c) for c in os.environ.get("CROSSCHECK_CONCURRENCY", "1,4").split(","))
CHUNK = int(os.environ.get("CROSSCHECK_CHUNK", "2048"))          # the server's --max-num-batched-tokens
TOLERANCE = float(os.environ.get("CROSSCHECK_TOLERANCE", "0.10"))
AIPERF = REPO / ".lt-aiperf" / "bin" / "aiperf"
TWO_CPUS = len(os.sched_getaffinity(0)) >= 2


def pinned(cmd: list[str], cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu), *cmd] if TWO_CPUS else cmd


def version() -> str:
    out = subprocess.run([str(REPO / ".lt-aiperf/bin/python"), "-c",
                          "import importlib.metadata as m; print(m.version('aiperf'))"], capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def server_ttft(server: LiveServer) -> tuple[float, float]:
    m = server.metrics()
    return (server.metric_of(m, "megakernel_time_to_first_token_seconds_sum"),
            server.metric_of(m, "megakernel_time_to_first_token_seconds_count"))


def ours_cmd(url: str, conc: int, out: Path, n: int = N, prompts: Path | None = None) -> list[str]:
    return pinned([sys.executable, "-m", "megakernel", "bench", "serve", "--no-progress", "--base-url", url,
                   "--backend", "torch", "--workloads", f"fixed:{P}:{O}", "--concurrency", str(conc),
                   "--num-requests", str(n), "--max-seconds", "900", "--warmup-requests", "0", "--json", str(out),
                   *(["--prompts", str(prompts)] if prompts else [])], 1)


def aiperf_prompts(path: Path, out: Path) -> Path:
    """aiperf's requests of a run (its inputs.json: prompt and max_tokens) as the list `bench serve --prompts`
    replays."""
    data = json.loads((path / "inputs.json").read_text())["data"]
    out.write_text(json.dumps([{"prompt": p["prompt"], "max_tokens": p["max_tokens"]} for d in data
                               for p in d["payloads"]]))
    return out


def aiperf_cmd(url: str, conc: int, out: Path, seconds: float | None = None) -> list[str]:
    bound = ["--benchmark-duration", str(seconds)] if seconds else ["--request-count", str(N)]
    return pinned([str(AIPERF), "profile", "--model", MODEL_NAME, "--url", url, "--endpoint-type", "completions",
                   "--streaming", "--concurrency", str(conc), *bound, "--tokenizer", str(EMBEDDED),
                   "--synthetic-input-tokens-mean", str(P), "--synthetic-input-tokens-stddev", "0",
                   "--output-tokens-mean", str(O), "--output-tokens-stddev", str(O_SD),
                   "--extra-inputs", "ignore_eos:true",
                   "--use-server-token-count", "--random-seed", "0", "--artifact-dir", str(out), "--ui-type", "none"],
                  1)


def read_ours(path: Path) -> dict[str, float]:
    return ours_figures(json.loads(path.read_text())["records"][0])


def ours_figures(r: dict) -> dict[str, float]:
    return {"window_unix": (r["started_at_unix"], r["ended_at_unix"]), "requests": r["requests_completed"],
            "failed": r["requests_failed"],
            "cut_at_the_limit": r["requests_incomplete"],
            "output_tokens": r["output_tokens"], "prompt_tokens": r["prompt_tokens"],
            "ttft_p50_s": r["ttft_p50_s"], "ttft_mean_s": r["ttft_mean_s"], "ttft_p90_s": r["ttft_p90_s"],
            "tpot_mean_s": r["tpot_mean_s"], "e2e_p50_s": r["e2e_p50_s"]}


def read_aiperf(path: Path) -> dict[str, float]:
    d = json.loads((path / "profile_export_aiperf.json").read_text())
    ttft = d["time_to_first_token"]
    return {"requests": d["request_count"]["avg"], "failed": sum(e.get("count", 1) for e in d.get("error_summary")
                                                                 or []),
            "output_tokens": d["usage_completion_tokens"]["sum"], "prompt_tokens": d["usage_prompt_tokens"]["sum"],
            "ttft_p50_s": ttft["p50"] / 1e3, "ttft_mean_s": ttft["avg"] / 1e3, "ttft_p90_s": ttft["p90"] / 1e3,
            "tpot_mean_s": d["inter_token_latency"]["avg"] / 1e3, "e2e_p50_s": d["request_latency"]["p50"] / 1e3}


def aiperf_ttft_within(path: Path, window: tuple[float, float]) -> dict[str, float]:
    """TTFT of aiperf's requests sent while ours ran (from its per-request export)."""
    import numpy as np

    rows = [json.loads(line) for line in (path / "profile_export.jsonl").read_text().splitlines() if line.strip()]
    ttft = [r["metrics"]["time_to_first_token"]["value"] / 1e3 for r in rows
            if window[0] <= r["metadata"]["request_start_ns"] / 1e9 <= window[1] and "time_to_first_token" in
            r["metrics"]]
    return {"requests": len(ttft), "share_of_run": len(ttft) / max(1, len(rows)),
            "ttft_p50_s": float(np.median(ttft)) if ttft else None,
            "ttft_mean_s": float(np.mean(ttft)) if ttft else None}


def run(cmd: list[str], tool: str) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"{tool} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def alone(server: LiveServer, conc: int, tmp: Path) -> tuple[dict, Path]:
    """aiperf by itself, then ours by itself on aiperf's prompts; returns the row and those prompts."""
    row: dict = {"mode": "alone", "concurrency": conc}
    a_out, o_out = tmp / f"aiperf-{conc}", tmp / f"ours-{conc}.json"
    prompts = tmp / f"prompts-{conc}.json"
    for tool in ("aiperf", "ours"):
        s0, n0 = server_ttft(server)
        if tool == "aiperf":
            run(aiperf_cmd(server.url, conc, a_out), tool)
            aiperf_prompts(a_out, prompts)
        else:
            run(ours_cmd(server.url, conc, o_out, prompts=prompts), tool)
        server.wait_idle()
        s1, n1 = server_ttft(server)
        row[tool] = read_aiperf(a_out) if tool == "aiperf" else read_ours(o_out)
        row[tool]["server_ttft_mean_s"] = (s1 - s0) / max(1.0, n1 - n0)
    a, b = row["ours"], row["aiperf"]
    row["match"] = all(a[k] == b[k] for k in ("requests", "output_tokens", "prompt_tokens")) and \
        a["failed"] == b["failed"] == 0
    return row, prompts


def side_by_side(server: LiveServer, conc: int, tmp: Path, prompts: Path) -> dict:
    """Both tools for T seconds at once: aiperf started first (its services take seconds to come up), our generator
    (already loaded in this process) the moment aiperf's first request reaches the server. Requests sent in the
    window, tokens received and TTFT are compared."""
    import asyncio

    from megakernel.bench_serve import Workload, replayed, run_load, summarize

    row: dict = {"mode": "side by side", "concurrency": conc, "seconds": T}
    a_out = tmp / f"aiperf-sbs-{conc}"
    w = Workload.parse(f"fixed:{P}:{O}")
    aiperf = subprocess.Popen(aiperf_cmd(server.url, conc, a_out, seconds=T), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=REPO)
    t0 = time.monotonic()
    while True:                       # wait for aiperf's first request
        m = server.metrics()
        if server.metric_of(m, "megakernel_num_requests_running") + \
                server.metric_of(m, "megakernel_num_requests_waiting") > 0:
            break
        if aiperf.poll() is not None or time.monotonic() - t0 > 300:
            raise RuntimeError(f"aiperf sent nothing:\n{aiperf.communicate()[0][-3000:]}")
        time.sleep(0.02)
    res = asyncio.run(run_load(server.url, MODEL_NAME, replayed(json.loads(prompts.read_text()), w, 0), conc, 1 << 30,
                               T, progress=False))
    out, _ = aiperf.communicate(timeout=1800)
    if aiperf.returncode != 0:
        raise RuntimeError(f"aiperf failed:\n{out[-3000:]}")
    server.wait_idle()
    rec = summarize(res)
    row["ours"], row["aiperf"] = ours_figures(rec), read_aiperf(a_out)
    row["ours"]["requests"] = rec["requests_sent"]      # sent in the window, as aiperf counts them
    row["aiperf_while_ours_ran"] = aiperf_ttft_within(a_out, row["ours"]["window_unix"])
    a, b = row["ours"], row["aiperf"]
    row["rel_diff"] = {k: abs(a[k] - b[k]) / b[k] for k in ("requests", "output_tokens", "ttft_p50_s", "ttft_mean_s",
                                                           "tpot_mean_s")}
    row["match"] = all(row["rel_diff"][k] <= TOLERANCE for k in ("requests", "output_tokens", "ttft_mean_s")) and \
        a["failed"] == b["failed"] == 0
    return row


def main() -> int:
    if not AIPERF.exists():
        print("aiperf is not installed: run scripts/bench_serve_crosscheck.sh (it installs it into .lt-aiperf)")
        return 2
    ver = version()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if TWO_CPUS:
            os.sched_setaffinity(0, {0})           # the server inherits CPU 0
        server = LiveServer(["--model", str(EMBEDDED), "--backend", "torch", "--block-size", "16", "--max-model-len",
                             str(P + 4 * O), "--kv-cache-memory", "128M",
                             "--max-num-batched-tokens", str(CHUNK), "--no-prefix-caching"], Path(tmp) / "server.log",
                            api_key=None)
        if TWO_CPUS:
            os.sched_setaffinity(0, {1})
        try:
            run(ours_cmd(server.url, 2, Path(tmp) / "warm.json", n=4), "warm-up")
            server.wait_idle()
            for conc in CONCURRENCY:
                row, prompts = alone(server, conc, Path(tmp))
                rows.append(row)
                print(json.dumps(row), flush=True)
                rows.append(side_by_side(server, conc, Path(tmp), prompts))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            server.stop()
    ok = all(r["match"] for r in rows)
    write_results(rows, ver, ok)
    return 0 if ok else 1


def write_results(rows: list[dict], ver: str, ok: bool) -> None:
    day = datetime.date.today().isoformat()
    res = Path(os.environ.get("CROSSCHECK_RESULTS_DIR", REPO / "benchmarks" / "results"))
    res.mkdir(parents=True, exist_ok=True)
    doc = {"date": day, "tool": "aiperf", "version": ver, "requests_per_run": N, "side_by_side_seconds": T,
           "prompt_tokens": P,
           "output_tokens": O, "tolerance": TOLERANCE, "pinned_cpus": TWO_CPUS, "all_match": ok, "runs": rows}
    (res / f"bench_serve_crosscheck_{day}.json").write_text(json.dumps(doc, indent=1) + "\n")

    def ms(v: float) -> str:
        return f"{1e3 * v:.1f}"

    lines = [f"# `megakernel bench serve` vs aiperf {ver} ({day})", "",
             f"`bash scripts/bench_serve_crosscheck.sh {N} {P} {O} {T:g}`: aiperf {ver} from the package index, run "
             "unchanged (`--endpoint-type completions --streaming --use-server-token-count --extra-inputs "
             f"ignore_eos:true`, synthetic {P}-token prompts, outputs of {O} +- {O_SD} tokens, normal), and "
             "`megakernel bench serve` replaying aiperf's requests (`--prompts`: its prompts and max_tokens), against "
             "one `megakernel serve` of the embedded north-nano on CPU (torch backend, prefill chunks of "
             f"{CHUNK} tokens, no prefix caching)"
             + (", the server pinned to CPU 0 and the tools to CPU 1." if TWO_CPUS else "."), "",
             f"Alone: each tool by itself, {N} requests (ours: the `--base-url` command); counts must be equal. The "
             "server's own mean TTFT over each run (its /metrics) shows how much the tool's own CPU use slowed the "
             f"server. Side by side: both tools at once for {T:g} s, each at the concurrency shown, on the same "
             f"server; requests sent, output tokens and mean TTFT within {TOLERANCE:.0%} (aiperf lets its last "
             f"requests finish after the {T:g} s, ours cuts them). Beside aiperf's TTFT p50 over its whole run, the "
             "p50 of its requests sent while ours ran.", "",
             "| mode | concurrency | requests ours / aiperf | output tokens ours / aiperf | TTFT p50 ms ours / "
             "aiperf (aiperf while ours ran) | TTFT mean ms ours / aiperf | server's TTFT mean ms (ours / aiperf "
             "run) | TPOT ms ours / aiperf | agree |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["ours"], r["aiperf"]
        srv = f"{ms(a['server_ttft_mean_s'])} / {ms(b['server_ttft_mean_s'])}" if "server_ttft_mean_s" in a else \
            "(one run)"
        win = r.get("aiperf_while_ours_ran")
        win_txt = f" ({ms(win['ttft_p50_s'])}, {win['requests']} requests)" if win and win["ttft_p50_s"] else ""
        lines.append(f"| {r['mode']} | {r['concurrency']} | {a['requests']:.0f} / {b['requests']:.0f} | "
                     f"{a['output_tokens']:.0f} / {b['output_tokens']:.0f} | {ms(a['ttft_p50_s'])} / "
                     f"{ms(b['ttft_p50_s'])}{win_txt} | {ms(a['ttft_mean_s'])} / {ms(b['ttft_mean_s'])} | {srv} | "
                     f"{ms(a['tpot_mean_s'])} / {ms(b['tpot_mean_s'])} | {'yes' if r['match'] else 'NO'} |")
    lines += ["", f"All agree: {'yes' if ok else 'NO'}. TPOT: (last token - first token) / (tokens - 1) per request, "
              "mean (aiperf calls it inter-token latency). Output lengths vary: equal lengths keep each tool's streams "
              "in phase, so that one tool's requests keep arriving during the other's prefill steps. Both tools send "
              "the same requests here; with its own token-id prompts (the benchmark's prompts on random weights) ours "
              "skips the server's tokenisation, which under load costs text requests tens of ms before they reach "
              "the engine."]
    (res / f"bench_serve_crosscheck_{day}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
