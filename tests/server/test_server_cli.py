"""`megakernel serve` as a user starts and stops it (issue 14): the README's commands work after serve.sh, bad flag
values are one-line errors, vLLM's flag names, SIGTERM/Ctrl-C with streams open, logs, `generate --chat`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server_harness import API_KEY, MODEL_NAME, REPO, LiveServer

ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def _serve(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "megakernel", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=REPO)


# ---- item 5 ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_readme_commands_after_serve_sh():
    readme = (REPO / "README.md").read_text()
    assert "source .venv/bin/activate" in readme
    p = subprocess.run(["bash", "scripts/serve.sh", "--version"], capture_output=True, text=True, timeout=600,
                       cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().startswith("megakernel ")
    assert "source .venv/bin/activate" in p.stderr                    # says how to get the command
    assert "pip" not in p.stderr.lower() or "setting up" in p.stderr  # no pip noise once set up
    p = subprocess.run(["bash", "-c", "source .venv/bin/activate && megakernel serve --help"], capture_output=True,
                       text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0 and "--max-num-seqs" in p.stdout


@pytest.mark.slow
def test_setup_is_skipped_when_up_to_date():
    subprocess.run(["bash", "scripts/setup.sh", "server,test"], check=True, capture_output=True, cwd=REPO,
                   timeout=900)
    t0 = time.time()
    p = subprocess.run(["bash", "scripts/setup.sh", "server,test"], capture_output=True, text=True, cwd=REPO,
                       timeout=600)
    assert p.returncode == 0 and p.stdout == "" and p.stderr == ""
    assert time.time() - t0 < 5


# ---- item 6 ------------------------------------------------------------------------------------------------------
BAD_FLAGS = [["--max-num-batched-tokens", "0"], ["--port", "99999"], ["--dtype", "int3"], ["--block-size", "0"],
             ["--max-batch-size", "0"], ["--max-num-seqs", "-1"], ["--max-model-len", "-5"],
             ["--max-model-len", "100000000"], ["--gpu-memory-utilization", "1.5"]]
if not __import__("torch").cuda.is_available():
    BAD_FLAGS += [["--device", "cuda"], ["--backend", "megakernel"]]


@pytest.mark.parametrize("flags", BAD_FLAGS, ids=[" ".join(f) for f in BAD_FLAGS])
def test_bad_flag_values_are_one_line_errors(flags):
    p = _serve(*flags)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr and "KV cache is too small" not in p.stderr
    name = flags[0].lstrip("-").replace("-", "_")
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(("error:", "megakernel serve: error:")) and "unrecognized" not in last, last
    assert name in last.replace("-", "_"), last


def test_bench_random_north_without_gpu():
    if __import__("torch").cuda.is_available():
        pytest.skip("a GPU is present")
    p = subprocess.run([sys.executable, "-m", "megakernel", "bench", "--random-north"], capture_output=True,
                       text=True, timeout=120, env=ENV, cwd=REPO)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "CUDA GPU" in p.stderr


def test_version_and_help_show_defaults():
    p = _serve("--version")
    assert p.returncode == 0 and p.stdout.startswith("megakernel 0.")
    help_text = " ".join(_serve("--help").stdout.split())         # argparse wraps lines
    for text in ("--max-num-seqs", "--max-batch-size", "--gpu-memory-utilization", "--chat-template",
                 "--allowed-origins", "(default: 16)", "(default: 8192 with the library prefill on a GPU, else 512)",
                 "(default: 8000)"):
        assert text in help_text, text


# ---- vLLM flags, logs (item 10), shutdown (item 7) -----------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_style(model_path, tmp_path_factory):
    """Started as vLLM users start it: positional model, --max-num-seqs, --allowed-origins, --chat-template."""
    tmpl = tmp_path_factory.mktemp("tmpl") / "t.jinja"
    tmpl.write_text((model_path / "chat_template.jinja").read_text().replace("{{- bos_token -}}",
                                                                            "{{- bos_token -}}TEMPLATED "))
    s = LiveServer([str(model_path), "--max-num-seqs", "4", "--allowed-origins", '["http://ui.example"]',
                    "--chat-template", str(tmpl), "--block-size", "16", "--max-model-len", "256",
                    "--kv-cache-memory", "32M", "--log-stats-interval", "0.5", "--log-level", "info"],
                   tmp_path_factory.mktemp("vllm") / "log")
    yield s
    s.stop()


def test_vllm_style_flags(vllm_style):
    s = vllm_style
    r = s.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, logprobs=True)
    assert r.usage.prompt_tokens > 0
    r = httpx.options(s.url + "/v1/chat/completions", headers={"Origin": "http://ui.example",
                                                               "Access-Control-Request-Method": "POST"})
    assert r.headers.get("access-control-allow-origin") == "http://ui.example"
    r = httpx.options(s.url + "/v1/chat/completions", headers={"Origin": "http://evil.example",
                                                               "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    m = s.metrics()
    assert s.metric_of(m, "megakernel_kv_blocks_total") > 0


def test_chat_template_flag(vllm_style, model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    msgs = [{"role": "user", "content": "hi"}]
    custom = (model_path / "chat_template.jinja").read_text().replace("{{- bos_token -}}",
                                                                     "{{- bos_token -}}TEMPLATED ")
    want = len(tok.apply_chat_template(msgs, chat_template=custom, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"])
    plain = len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])
    got = vllm_style.client().chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=1).usage
    assert got.prompt_tokens == want != plain


def test_logs(vllm_style):
    s = vllm_style
    c = s.client()
    import openai

    with pytest.raises(openai.BadRequestError):     # past the tokenizer's model_max_length (4096): no warning
        c.completions.create(model=MODEL_NAME, prompt="word " * 6000, max_tokens=1)
    c.completions.create(model=MODEL_NAME, prompt="def main():", max_tokens=40, extra_body={"ignore_eos": True})
    time.sleep(1.2)
    log = s.log()
    assert "megakernel: megakernel:" not in log and "megakernel.server: megakernel:" not in log
    assert "Token indices sequence length" not in log
    assert "model loaded in" in log and "loading" in log
    assert "generation" in log and "tok/s" in log and "running" in log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_shutdown_with_open_streams(model_path, tmp_path, sig):
    s = LiveServer(["--model", str(model_path), "--block-size", "16", "--max-model-len", "512",
                    "--kv-cache-memory", "32M"], tmp_path / "log")
    ends: list[list[str]] = [[], []]
    started = threading.Barrier(3)

    def stream(k):
        body = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, headers=s.headers, timeout=60) as r:
            first = True
            for line in r.iter_lines():
                if line:
                    ends[k].append(line)
                    if first:
                        first = False
                        started.wait(30)

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    started.wait(30)
    t0 = time.time()
    s.proc.send_signal(sig)
    for t in threads:
        t.join(30)
    took = time.time() - t0
    s.proc.wait(30)
    log = s.log()
    s.stop()
    assert took < 3, f"streams ended {took:.1f} s after the signal"
    for lines in ends:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        err = json.loads(lines[-2][len("data: "):])
        assert err["error"]["type"] == "server_error" and "shutting down" in err["error"]["message"]
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]


# ---- item 8: generate --chat -----------------------------------------------------------------------------------
def test_generate_chat_keeps_reasoning_apart():
    p = subprocess.run([sys.executable, "-m", "megakernel", "generate", "--chat", "--prompt",
                        "Write a function `add(a, b)` that returns the sum of a and b."], capture_output=True,
                       text=True, timeout=300, env=ENV, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert "[reasoning]" in p.stderr
    reasoning = p.stderr.split("[reasoning]", 1)[1].strip().splitlines()[0]
    assert reasoning and reasoning not in p.stdout
    assert "def add" in p.stdout


def test_llm_chat_reasoning_apart_and_off():
    from megakernel import LLM, SamplingParams

    llm = LLM()
    msgs = [{"role": "user", "content": "Write is_even(n)."}]
    on = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=80), use_tqdm=False)[0].outputs[0]
    assert on.reasoning and on.reasoning not in on.text and "<|" not in on.text
    off = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=80), use_tqdm=False, reasoning=False)[0]
    assert off.outputs[0].reasoning is None and off.text and "<|" not in off.text
