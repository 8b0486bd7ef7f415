"""What a new user hit (issue 14), through the live server: one stream entry per choice per chunk, malformed text is
a 400 naming the field, a huge request does not stall /health, body-size cap, load tools' options
(continuous_usage_stats, HEAD probes), fields that change nothing are accepted, x-request-id, reasoning off."""

from __future__ import annotations

import gc
import json
import threading
import time

import httpx
import pytest

from server_harness import MODEL_NAME

CHAT = "/v1/chat/completions"
PROMPTS = ["What is 2+2?", "Write is_even(n).", "Hello!", "Sort a list in Python.", "What is a tuple?",
           "Explain recursion.", "def add(a, b):", "Weather in Paris?"]


# ---- item 1 ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2])
def test_chat_stream_one_entry_per_choice_per_chunk(client, n):
    for prompt in PROMPTS:
        finishes = {}
        last_with_choices = None
        for chunk in client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=24, temperature=0.7, seed=1, n=n, stream=True):
            idx = [c.index for c in chunk.choices]
            assert len(idx) == len(set(idx)), chunk
            for c in chunk.choices:
                if c.finish_reason:
                    assert c.index not in finishes
                    finishes[c.index] = c.finish_reason
            if chunk.choices:
                last_with_choices = chunk
        assert set(finishes) == set(range(n))
        if n == 1:
            assert last_with_choices.choices[0].finish_reason in ("stop", "length")


# ---- item 3 ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"model": "M", "prompt": "abc\\ud800", "max_tokens": 2}', "prompt"),
    (CHAT, '{"model": "M", "messages": [{"role": "user", "content": "abc\\ud800"}]}', "messages.0.content"),
    (CHAT, '{"model": "M", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages.0.content.0.text"),
    (CHAT, '{"model": "M", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
           '"function": {"name": "f", "description": "abc\\ud800"}}]}', "tools.0.function.description"),
    (CHAT, '{"model": "M", "messages": [{"role": "user", "content": "x"}], "stop": ["\\ud800"]}', "stop.0"),
])
def test_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, content=body.replace('"M"', json.dumps(MODEL_NAME)).encode(),
                   headers={**server.headers, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert "Traceback" not in server.log() and "TypeError" not in server.log()


# ---- item 4 ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_health_answers_while_a_huge_request_is_tokenised(server):
    """8 MB prompts, completions and chat, one after another for 3 s, each refused for its length, while /health is
    probed: no probe may wait 100 ms. (A prompt is tokenised only as far as the context length needs, so one such
    request takes well under a second; before, one took 5-7 s and its million-token encoding, freed under the GIL,
    stalled the event loop for 50-400 ms.)"""
    big_text = "word " * (8 * 1024 * 1024 // 5)
    # bodies encoded once: json.dumps of 8 MB holds this process's GIL for ~15 ms, which the probes would wait out
    bodies = [("/v1/completions", {"model": MODEL_NAME, "prompt": big_text, "max_tokens": 1}),
              (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": big_text}], "max_tokens": 1})]
    bodies = [(path, json.dumps(body).encode()) for path, body in bodies]
    results = []

    def big():
        t_end = time.perf_counter() + 3.0
        with httpx.Client(timeout=120, headers={**server.headers, "Content-Type": "application/json"}) as c:
            while time.perf_counter() < t_end:
                path, body = bodies[len(results) % 2]
                t0 = time.perf_counter()
                r = c.post(server.url + path, content=body)
                results.append((path, r, time.perf_counter() - t0, t0 - start))

    # This process's own garbage collections are kept out of the window: by the time a full run reaches this test
    # it tracks ~0.5-1M objects (torch, transformers, every test module), and one collection of the oldest generation
    # took 220-250 ms here (300 in CI), under this process's GIL, so both the probe and the request in flight waited
    # for it. The two CI failures (2026-12-04/05) were one ~300 ms stall each, the slowest request the same length.
    gc.collect()
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        th = threading.Thread(target=big)
        th.start()
        time.sleep(0.3)                 # the first body is uploaded and parsed, tokenising starts
        worst, worst_at = 0.0, 0.0
        n = 0
        # One client for every probe, each on a new connection: httpx.get builds a client per call, whose SSL context
        # alone took ~20 ms (up to ~80 on this 2-core machine) against a server that answers in ~1 ms, and those
        # client-side costs, not the server, had pushed the worst probe past 100 ms in full CI runs (2026-12-02)
        with httpx.Client(timeout=5, headers={"Connection": "close"}) as probe:
            while th.is_alive():
                t0 = time.perf_counter()
                assert probe.get(server.url + "/health").status_code == 200
                dt = time.perf_counter() - t0
                if dt > worst:
                    worst, worst_at = dt, t0 - start
                n += 1
                time.sleep(0.02)
        th.join(120)
    finally:
        if gc_was_on:
            gc.enable()
    assert len(results) >= 2 and {path for path, *_ in results} == {"/v1/completions", CHAT}
    for path, r, _, _ in results:
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", (path, r.text)
    assert n >= 10, f"{n} probes: nothing measured"
    # which request was slowest and when, beside the worst probe's start: a stall in the server shows in both
    i_slow = max(range(len(results)), key=lambda i: results[i][2])
    print(f"/health during {len(results)} 8 MB requests (slowest: #{i_slow}, {results[i_slow][2]:.2f} s from "
          f"{results[i_slow][3]:.2f} s): {n} probes, worst {1000 * worst:.0f} ms from {worst_at:.2f} s")
    assert worst < 0.1


def test_body_over_the_cap_is_413(server):
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (33 << 20),
                   headers={**server.headers, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(server.url + "/health").status_code == 200


# ---- item 9 ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats(client, endpoint):
    kw = dict(model=MODEL_NAME, max_tokens=12, temperature=0, stream=True,
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    stream = client.chat.completions.create(messages=[{"role": "user", "content": "Hello"}], **kw) \
        if endpoint == "chat" else client.completions.create(prompt="def main():", **kw)
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts)
    final = chunks[-1]
    assert not final.choices and final.usage.completion_tokens >= counts[-1]
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
    # false is accepted too (guidellm sends it either way)
    kw["stream_options"] = {"include_usage": True, "continuous_usage_stats": False}
    chunks = list(client.completions.create(prompt="x", **kw))
    assert all(c.usage is None for c in chunks if c.choices) and chunks[-1].usage is not None


def test_head_probes(server):
    for path in ("/health", "/metrics", "/v1/models"):
        r = httpx.head(server.url + path, headers=server.headers, timeout=10)
        assert r.status_code == 200, (path, r.status_code)


# ---- also build: fields, request ids --------------------------------------------------------------------------
def test_fields_that_change_nothing_are_accepted(client, server):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       store=False, metadata={"team": "a"}, user="u1", service_tier="auto",
                                       reasoning_effort="low", extra_body={"safety_identifier": "x"})
    assert r.choices[0].finish_reason in ("stop", "length")
    for field, value in (("prediction", {"type": "content", "content": "x"}), ("audio", {"voice": "alloy"}),
                         ("modalities", ["text", "audio"]), ("web_search_options", {})):
        r = httpx.post(server.url + CHAT, headers=server.headers, timeout=30, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)


def test_reasoning_off_returns_no_reasoning(client):
    for prompt in PROMPTS[:5]:
        kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=40, temperature=0)
        on = client.chat.completions.create(**kw)
        assert getattr(on.choices[0].message, "reasoning_content", None)         # the model does reason
        for off in (client.chat.completions.create(reasoning_effort="none", **kw),
                    client.chat.completions.create(extra_body={"chat_template_kwargs": {"reasoning": False}}, **kw)):
            assert not getattr(off.choices[0].message, "reasoning_content", None), off.choices[0].message
            assert "<|" not in (off.choices[0].message.content or "")


def test_request_id_on_every_response(server):
    r = httpx.get(server.url + "/health")
    assert len(r.headers["x-request-id"]) >= 16
    r = httpx.get(server.url + "/nope", headers={"x-request-id": "abc-123"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "abc-123"
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers, timeout=30,
                      json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "stream": True}) as s:
        assert s.headers["x-request-id"]
    r = httpx.post(server.url + CHAT, headers=server.headers, json={"model": "nope", "messages": []})
    assert r.status_code == 400 and r.headers["x-request-id"]
