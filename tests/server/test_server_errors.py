"""Bad input: each answered with OpenAI's error shape and the right status, and the server still serves after.
Also: wrong API key, clients that disconnect (streaming or not) are aborted and their KV blocks freed, and a
schemathesis run against the served OpenAPI schema finds no 5xx."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from server_harness import API_KEY, MODEL_NAME

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hello"}]


def _post(server, path, body=None, *, content=None, headers=None):
    h = dict(server.headers)
    h.update(headers or {})
    if content is not None:
        h.setdefault("Content-Type", "application/json")
        return httpx.post(server.url + path, content=content, headers=h, timeout=60)
    return httpx.post(server.url + path, json=body, headers=h, timeout=60)


def _assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


BAD_REQUESTS = [
    # (path, body or raw bytes, status, param)
    ("malformed_json", COMP, b'{"model": "x", "prompt": ', 400, None),
    ("not_an_object", COMP, b"[1, 2]", 400, None),
    ("empty_body", CHAT, b"", 400, None),
    ("max_tokens_string", COMP, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("temperature_string", CHAT, {"messages": USER, "temperature": "hot"}, 400, "temperature"),
    ("messages_not_list", CHAT, {"messages": "hello"}, 400, "messages"),
    ("prompt_wrong_type", COMP, {"prompt": {"text": "x"}}, 400, "prompt"),
    ("prompt_mixed_list", COMP, {"prompt": [1, "a"]}, 400, None),
    ("negative_max_tokens", COMP, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("zero_max_tokens", CHAT, {"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ("huge_max_tokens", COMP, {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("huge_max_completion_tokens", CHAT, {"messages": USER, "max_completion_tokens": 10**30}, 400,
     "max_completion_tokens"),
    ("prompt_too_long_ids", COMP, {"prompt": [5] * 600}, 400, "prompt"),
    ("prompt_too_long_text", CHAT, {"messages": [{"role": "user", "content": "word " * 1200}]}, 400, "messages"),
    ("token_id_outside_vocab", COMP, {"prompt": [1, 10**9]}, 400, "prompt"),
    ("empty_prompt", COMP, {"prompt": ""}, 400, "prompt"),
    ("empty_prompt_list", COMP, {"prompt": []}, 400, "prompt"),
    ("empty_messages", CHAT, {"messages": []}, 400, "messages"),
    ("unknown_role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0"),
    ("missing_content", CHAT, {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("tool_message_without_id", CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages.0.tool_call_id"),
    ("image_part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, None),
    ("n_zero", CHAT, {"messages": USER, "n": 0}, 400, "n"),
    ("n_negative", COMP, {"prompt": "x", "n": -1}, 400, "n"),
    ("temperature_too_high", COMP, {"prompt": "x", "temperature": 5}, 400, "temperature"),
    ("top_p_zero", COMP, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("nan_temperature", COMP, b'{"model": "MODEL", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("logprobs_too_many", COMP, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("top_logprobs_without_logprobs", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("logit_bias_bad_key", COMP, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit_bias_outside_vocab", COMP, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("logit_bias_bad_value", COMP, {"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("empty_stop", COMP, {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("stop_token_outside_vocab", COMP, {"prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("unknown_field", CHAT, {"messages": USER, "frobnicate": True}, 400, "frobnicate"),
    ("unsupported_functions", CHAT, {"messages": USER, "functions": [{"name": "f"}]}, 400, "functions"),
    ("unsupported_response_format", CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400,
     "response_format"),
    ("json_schema_without_schema_name", CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, 400, "response_format.json_schema.name"),
    ("json_schema_invalid_schema", CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "two"}}}},
     400, "response_format"),
    ("unsupported_suffix", COMP, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("unsupported_best_of", COMP, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("unsupported_echo_logprobs", COMP, {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ("unsupported_strict_tools", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object"}}}]}, 400, "tools.0.function.strict"),
    ("tool_choice_unknown_function", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("tool_choice_without_tools", CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    ("bad_tool_choice", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                               "tool_choice": "sometimes"}, 400, "tool_choice"),
    ("stream_options_without_stream", COMP, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("bad_template_kwargs", CHAT, {"messages": USER, "chat_template_kwargs": {"tools": []}}, 400,
     "chat_template_kwargs"),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request(server, name, path, body, status, param):
    if isinstance(body, bytes):
        r = _post(server, path, content=body.replace(b"MODEL", MODEL_NAME.encode()))
    else:
        r = _post(server, path, {"model": MODEL_NAME, "max_tokens": 2, **body} if "max_tokens" not in body and
                  "max_completion_tokens" not in body else {"model": MODEL_NAME, **body})
    _assert_error(r, status, param)


def test_unknown_model(server):
    for path, body in ((COMP, {"prompt": "x"}), (CHAT, {"messages": USER})):
        _assert_error(_post(server, path, {"model": "gpt-17", **body}), 404, "model", "model_not_found")
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-17", prompt="x", max_tokens=1)


def test_openai_client_errors(server):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=2)
    assert e.value.status_code == 400 and e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=10**9)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL_NAME, messages=USER, n=0)


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + API_KEY},
                    {"Authorization": API_KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", COMP), ("POST", CHAT)):
            r = httpx.request(method, server.url + path, headers=headers, timeout=30,
                              json={"model": MODEL_NAME, "prompt": "x", "messages": USER})
            _assert_error(r, 401, code="invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200      # not behind the key
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_not_found_and_method(server):
    _assert_error(httpx.get(server.url + "/v1/nothing-here", headers=server.headers), 404)
    _assert_error(httpx.delete(server.url + COMP, headers=server.headers), 405)


def _abort_count(server) -> float:
    m = server.metrics()
    return sum(v for k, v in m.items() if k.startswith("megakernel_requests_total{") and 'finish_reason="abort"' in k)


def _one_abort_then_idle(server, before: int):
    """Wait until the server counted exactly one more aborted request and went idle with every KV block free;
    returns the idle metrics."""
    t0 = time.time()
    while _abort_count(server) <= before and time.time() - t0 < 30:
        time.sleep(0.1)
    assert _abort_count(server) == before + 1
    m = server.wait_idle()
    assert server.metric_of(m, "megakernel_kv_blocks_in_use") == 0
    return m


def test_disconnect_mid_stream_aborts(server):
    before = _abort_count(server)
    body = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": 480, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + COMP, json=body, headers=server.headers, timeout=60) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += 1
                if got >= 3:
                    break                                        # hang up mid-stream
    m = _one_abort_then_idle(server, before)
    assert server.metric_of(m, "megakernel_num_requests_running") == 0
    # still serving
    r = server.client().completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_disconnect_non_stream_aborts(server):
    before = _abort_count(server)
    body = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": 480, "ignore_eos": True, "n": 4}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + COMP, json=body, headers=server.headers, timeout=0.5)
    _one_abort_then_idle(server, before)
    assert httpx.get(server.url + "/health").status_code == 200


def test_still_serving_after_errors(server):
    for name, path, body, status, param in BAD_REQUESTS[:10]:
        if isinstance(body, bytes):
            _post(server, path, content=body)
        else:
            _post(server, path, {"model": MODEL_NAME, **body})
    r = server.client().chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


@pytest.fixture(scope="module")
def fuzz_server(model_path, tmp_path_factory):
    """Short contexts and a wide batch, so that fuzzed requests with n=64 and many prompts finish quickly."""
    from server_harness import LiveServer

    s = LiveServer(["--model", str(model_path), "--block-size", "16", "--max-model-len", "24",
                    "--max-batch-size", "64", "--kv-cache-memory", "16M"], tmp_path_factory.mktemp("fuzz") / "log")
    yield s
    s.stop()


@pytest.mark.slow
def test_schemathesis_no_server_errors(fuzz_server, tmp_path):
    pytest.importorskip("schemathesis")
    server = fuzz_server
    budget = os.environ.get("MEGAKERNEL_SCHEMATHESIS_SECONDS", "60")
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json",
           "--checks", "not_a_server_error", "--phases", "examples,coverage,fuzzing", "--max-examples", "30",
           "--max-time", budget, "--generation-database", "none", "--seed", "1", "--no-color",
           "--request-timeout", "120", "--workers", "2", "-H", f"Authorization: Bearer {API_KEY}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=int(budget) + 240, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
    assert httpx.get(server.url + "/health").status_code == 200
    m = server.wait_idle(timeout=120)
    assert server.metric_of(m, "megakernel_kv_blocks_in_use") == 0
    statuses = {k: v for k, v in m.items() if k.startswith("megakernel_http_requests_total{")}
    served = sum(v for k, v in statuses.items() if 'status="200"' in k and "completions" in k)
    assert served > 0, statuses                    # the fuzzer reached generation, not only validation
    assert not any(v for k, v in statuses.items() if 'status="5' in k), statuses
    print("schemathesis:", p.stdout.strip().splitlines()[-3:], statuses)
