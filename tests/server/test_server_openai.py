"""The official openai client against a live server: completions and chat, streaming and not, n > 1, logprobs,
stop strings, seeds, echo, usage (cached tokens), penalties and logit bias."""

from __future__ import annotations

import openai
import pytest

from server_harness import MODEL_NAME

PROMPTS = ["def fibonacci(n):", "import json\n\nclass Decoder:", "The weather in Paris is",
           "for i in range(10):\n    print(", "Hello! How can I help you today?"]


def _complete(client, prompt, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 12)
    return client.completions.create(model=MODEL_NAME, prompt=prompt, **kw)


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.text or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_text_prompt(client):
    r = _complete(client, PROMPTS[0])
    assert r.object == "text_completion" and r.model == MODEL_NAME
    c = r.choices[0]
    assert isinstance(c.text, str) and c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_token_ids_and_lists(client, server):
    tok_ids = [294, 91, 345, 322, 284, 91, 83]
    single = _complete(client, tok_ids)
    assert single.usage.prompt_tokens == len(tok_ids)
    batch = _complete(client, [tok_ids, [5, 17, 42, 99]])
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == single.choices[0].text      # greedy: same text inside a batch of prompts
    texts = _complete(client, PROMPTS[:3], max_tokens=6)
    assert len(texts.choices) == 3
    for i, p in enumerate(PROMPTS[:3]):
        assert texts.choices[i].text == _complete(client, p, max_tokens=6).choices[0].text


def test_completion_stream_equals_non_stream(client):
    for p in PROMPTS[:3]:
        full = _complete(client, p, max_tokens=16)
        texts, reasons, usage = _stream_text(_complete(client, p, max_tokens=16, stream=True,
                                                       stream_options={"include_usage": True}))
        assert texts[0] == full.choices[0].text
        assert reasons[0] == full.choices[0].finish_reason
        assert usage.completion_tokens == full.usage.completion_tokens
        assert usage.prompt_tokens == full.usage.prompt_tokens


def test_n_greater_than_one(client):
    r = _complete(client, PROMPTS[1], n=3, temperature=1.0, seed=7, max_tokens=10)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1          # independent samples
    texts, reasons, _ = _stream_text(_complete(client, PROMPTS[1], n=3, temperature=1.0, seed=7, max_tokens=10,
                                               stream=True))
    assert texts == {c.index: c.text for c in r.choices}  # same seed, same samples, streamed
    assert set(reasons) == {0, 1, 2}
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=5, temperature=1.0, seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_seed_reproducible(client):
    a = _complete(client, PROMPTS[2], temperature=1.0, seed=1234, max_tokens=16)
    b = _complete(client, PROMPTS[2], temperature=1.0, seed=1234, max_tokens=16)
    c = _complete(client, PROMPTS[2], temperature=1.0, seed=999, max_tokens=16)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != c.choices[0].text
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me a story"}], temperature=0.9,
              top_p=0.95, seed=42, max_tokens=12)
    x = client.chat.completions.create(**kw)
    y = client.chat.completions.create(**kw)
    assert x.choices[0].message == y.choices[0].message


def test_completion_logprobs(client):
    r = _complete(client, PROMPTS[0], logprobs=3, max_tokens=8)
    lp = r.choices[0].logprobs
    n = len(lp.tokens)
    assert n == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert n >= r.usage.completion_tokens - 1
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)   # greedy picks the most likely token
    assert "".join(lp.tokens) == r.choices[0].text
    # streaming: the same logprobs, chunk by chunk
    toks = []
    for chunk in _complete(client, PROMPTS[0], logprobs=3, max_tokens=8, stream=True):
        for c in chunk.choices:
            if c.logprobs:
                toks += c.logprobs.tokens
    assert toks == lp.tokens


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert 1 <= len(content) <= 6
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)


def test_stop_strings(client):
    for p in PROMPTS:
        base = _complete(client, p, max_tokens=24).choices[0].text
        if len(base) >= 12:
            break
    stop = base[6:9]
    expect = base[:base.find(stop)]
    r = _complete(client, p, max_tokens=24, stop=[stop, "zzzz-never"])
    assert r.choices[0].text == expect
    assert r.choices[0].finish_reason == "stop"
    texts, reasons, _ = _stream_text(_complete(client, p, max_tokens=24, stop=stop, stream=True))
    assert texts[0] == expect and reasons[0] == "stop"
    inc = _complete(client, p, max_tokens=24, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert inc.choices[0].text == expect + stop


def _greedy_ids(client, prompt, n, **kw):
    r = _complete(client, prompt, max_tokens=n, logprobs=0, extra_body={"return_tokens_as_token_ids": True,
                                                                        "ignore_eos": True,
                                                                        **kw.pop("extra_body", {})}, **kw)
    return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens], r


def test_stop_token_ids(client):
    ids, r = _greedy_ids(client, PROMPTS[0], 10)
    assert len(ids) >= 3
    stop_id = ids[2]
    first = ids.index(stop_id)
    ids2, r2 = _greedy_ids(client, PROMPTS[0], 10, extra_body={"stop_token_ids": [stop_id]})
    assert r2.choices[0].finish_reason == "stop"
    assert ids2 == ids[:first]                       # the stop token itself is not part of the answer
    assert r2.usage.completion_tokens == first + 1


def test_echo(client):
    r = _complete(client, PROMPTS[0], echo=True, max_tokens=5)
    plain = _complete(client, PROMPTS[0], max_tokens=5)
    assert r.choices[0].text == PROMPTS[0] + plain.choices[0].text
    texts, _, _ = _stream_text(_complete(client, PROMPTS[0], echo=True, max_tokens=5, stream=True))
    assert texts[0] == r.choices[0].text


def test_prefix_cache_hit_same_output(client):
    # long enough for several full 16-token blocks
    prompt = "import os\nimport sys\nimport json\n\n" + "def handler(event, context):\n    return event\n" * 4
    first = _complete(client, prompt, max_tokens=16)
    second = _complete(client, prompt, max_tokens=16)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text
    # a shared prefix with a different tail also hits, and the tail's text matches a cold run's
    other = prompt + "\nclass Foo:"
    hit = _complete(client, other, max_tokens=16)
    assert hit.usage.prompt_tokens_details.cached_tokens >= 16


def test_penalties_and_logit_bias(client):
    ids, _ = _greedy_ids(client, PROMPTS[0], 4, logit_bias={"300": 100})
    assert ids == [300] * 4                          # always the biased token
    ids, _ = _greedy_ids(client, PROMPTS[0], 4, logit_bias={"300": 100}, temperature=1.0, seed=5)
    assert ids == [300] * 4
    base, _ = _greedy_ids(client, PROMPTS[3], 16)
    pen, _ = _greedy_ids(client, PROMPTS[3], 16, frequency_penalty=2.0, presence_penalty=2.0)
    assert len(set(pen)) >= len(set(base))           # penalties discourage repeats


def test_chat_basic_and_stream(client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16, temperature=0)
    m = r.choices[0].message
    assert r.object == "chat.completion" and m.role == "assistant"
    reasoning = getattr(m, "reasoning_content", None) or ""
    assert (m.content or "") + reasoning, "empty answer"
    assert r.usage.completion_tokens <= 16
    stream = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    content = reasoning_s = ""
    role = finish = usage = None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            role = role or c.delta.role
            content += c.delta.content or ""
            reasoning_s += getattr(c.delta, "reasoning_content", None) or ""
            finish = c.finish_reason or finish
    assert role == "assistant"
    assert content == (m.content or "") and reasoning_s == reasoning
    assert finish == r.choices[0].finish_reason
    assert usage.completion_tokens == r.usage.completion_tokens


def test_chat_multi_turn_and_developer_role(client):
    msgs = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
            {"role": "user", "content": "Bye"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10


def test_async_client_concurrent(server):
    import asyncio

    async def main():
        c = server.async_client()
        rs = await asyncio.gather(*[c.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8, temperature=0)
                                    for p in PROMPTS])
        await c.close()
        return [r.choices[0].text for r in rs]

    texts = asyncio.run(main())
    client = server.client()
    assert texts == [_complete(client, p, max_tokens=8).choices[0].text for p in PROMPTS]


def test_engine_import_does_not_pull_the_server():
    import subprocess
    import sys

    code = "import megakernel, sys; assert 'fastapi' not in sys.modules and 'megakernel.server' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
