"""The body of scripts/loadtools_check.sh: start a server, run each load tool per (endpoint, concurrency), compare
what the tool counted with the deltas of the server's /metrics, write the results file. Exit 1 on any mismatch."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from megakernel.default_model import EMBEDDED
from server_harness import MODEL_NAME, LiveServer     # tests/server, on PYTHONPATH (loadtools_check.sh sets it)

REPO = Path(__file__).resolve().parents[1]

N = int(sys.argv[1]) if len(sys.argv) > 1 else 24
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 32
COUNTERS = {"requests": "megakernel_requests_total", "prompt_tokens": "megakernel_prompt_tokens_total",
            "generation_tokens": "megakernel_generation_tokens_total"}


def version(tool: str) -> str:
    out = subprocess.run([str(REPO / f".lt-{tool}/bin/python"), "-c",
                          f"import importlib.metadata as m; print(m.version('{tool}'))"], capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def counters(server: LiveServer) -> dict[str, float]:
    m = server.metrics()
    out = {k: server.metric_of(m, v) for k, v in COUNTERS.items()}
    out["http_errors"] = sum(v for k, v in m.items() if k.startswith("megakernel_http_requests_total{")
                             and not re.search(r'status="(2\d\d)"', k))
    return out


def run_guidellm(url: str, endpoint: str, conc: int, out: Path) -> dict[str, float]:
    fmt = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    cmd = [str(REPO / ".lt-guidellm/bin/guidellm"), "run",
           "--backend", f"kind=openai_http,target={url},model={MODEL_NAME},request_format={fmt}",
           "--profile", f"kind=concurrent,streams={conc}", "--constraint", f"kind=max_requests,count={N}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=hf_auto,model={EMBEDDED}", "--output", f"kind=json,path={out / 'g.json'}",
           "--disable-console-interactive"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=out)
    if p.returncode != 0:
        raise RuntimeError(f"guidellm failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    m = json.loads((out / "g.json").read_text())["benchmarks"][0]["metrics"]
    tot = m["request_totals"]
    return {"requests": tot["successful"], "failed": tot["errored"] + tot["incomplete"],
            "prompt_tokens": m["prompt_token_count"]["successful"]["total_sum"],
            "generation_tokens": m["output_token_count"]["successful"]["total_sum"]}


def run_aiperf(url: str, endpoint: str, conc: int, out: Path) -> dict[str, float]:
    cmd = [str(REPO / ".lt-aiperf/bin/aiperf"), "profile", "--model", MODEL_NAME, "--url", url,
           "--endpoint-type", "chat" if endpoint == "chat" else "completions", "--streaming",
           "--concurrency", str(conc), "--request-count", str(N), "--tokenizer", str(EMBEDDED),
           "--synthetic-input-tokens-mean", str(PROMPT_TOKENS), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0",
           "--use-server-token-count", "--artifact-dir", str(out / "a"), "--ui-type", "none"]
    if endpoint == "chat":          # aiperf sends continuous_usage_stats on chat only
        cmd.append("--per-chunk-usage")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=out)
    if p.returncode != 0:
        raise RuntimeError(f"aiperf failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    d = json.loads((out / "a" / "profile_export_aiperf.json").read_text())
    failed = sum(e.get("count", 1) for e in d.get("error_summary") or [])
    return {"requests": d["request_count"]["avg"], "failed": failed,
            "prompt_tokens": d["usage_prompt_tokens"]["sum"], "generation_tokens": d["usage_completion_tokens"]["sum"]}


def main() -> int:
    tools = {"guidellm": run_guidellm, "aiperf": run_aiperf}
    versions = {t: version(t) for t in tools}
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        server = LiveServer(["--model", str(EMBEDDED), "--block-size", "16", "--max-model-len", "512",
                             "--kv-cache-memory", "64M"], Path(tmp) / "server.log", api_key=None)
        try:
            for tool, fn in tools.items():
                for endpoint in ("chat", "completions"):
                    for conc in (1, 4):
                        out = Path(tmp) / f"{tool}-{endpoint}-{conc}"
                        out.mkdir()
                        before = counters(server)
                        got = fn(server.url, endpoint, conc, out)
                        server.wait_idle()
                        after = counters(server)
                        delta = {k: after[k] - before[k] for k in after}
                        match = got["failed"] == 0 and delta["http_errors"] == 0 and all(
                            got[k] == delta[k] for k in COUNTERS)
                        ok &= match
                        rows.append({"tool": tool, "version": versions[tool], "endpoint": endpoint,
                                     "concurrency": conc, "tool_counts": got, "server_metrics_delta": delta,
                                     "match": match})
                        print(json.dumps(rows[-1]), flush=True)
        finally:
            server.stop()
    write_results(rows, versions, ok)
    return 0 if ok else 1


def write_results(rows: list[dict], versions: dict[str, str], ok: bool) -> None:
    day = datetime.date.today().isoformat()
    res = Path(os.environ.get("LOADTOOLS_RESULTS_DIR", REPO / "benchmarks" / "results"))
    res.mkdir(parents=True, exist_ok=True)
    (res / f"loadtools_{day}.json").write_text(json.dumps({"date": day, "versions": versions, "requests_per_run": N,
                                                           "all_match": ok, "runs": rows}, indent=2) + "\n")
    lines = [f"# Load tools against `megakernel serve` ({day})", "",
             f"`bash scripts/loadtools_check.sh {N}`: guidellm {versions['guidellm']} and aiperf {versions['aiperf']} "
             f"from the package index, unchanged (aiperf with `--use-server-token-count`, plus `--per-chunk-usage` on "
             f"chat), "
             f"{N} streaming requests per run ({PROMPT_TOKENS} prompt / {OUTPUT_TOKENS} output tokens, synthetic), "
             "embedded north-nano on CPU. Tool counts vs the deltas of the server's /metrics.", "",
             "| tool | endpoint | concurrency | ok / failed (tool) | requests (/metrics) | prompt tokens tool / "
             "server | generation tokens tool / server | match |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, d = r["tool_counts"], r["server_metrics_delta"]
        lines.append(f"| {r['tool']} {r['version']} | {r['endpoint']} | {r['concurrency']} | {t['requests']:.0f} / "
                     f"{t['failed']:.0f} | {d['requests']:.0f} | {t['prompt_tokens']:.0f} / {d['prompt_tokens']:.0f} "
                     f"| {t['generation_tokens']:.0f} / {d['generation_tokens']:.0f} | "
                     f"{'yes' if r['match'] else 'NO'} |")
    lines += ["", f"All runs match: {'yes' if ok else 'NO'}."]
    (res / f"loadtools_{day}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
