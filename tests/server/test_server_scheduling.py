"""Scheduling through the live server: greedy outputs are identical alone vs inside a busy batch, with vs without
a prefix-cache hit, with vs without preemption; 64 concurrent streaming clients under a KV budget that forces
preemption all complete with their solo text, every KV block is free afterwards and the server still answers."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from server_harness import MODEL_NAME

WORDS = ("alpha beta gamma delta import return yield class def lambda while for print json value key "
         "list dict tuple set open close read write socket thread async await error raise try except").split()


def _prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _solo(client, prompt, max_tokens, **kw):
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True}, **kw)
    return r.choices[0].text


async def _stream_one(aclient, prompt, max_tokens, **kw) -> tuple[str, str, int]:
    stream = await aclient.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                              temperature=kw.pop("temperature", 0), stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}, **kw)
    text, reason, ntok = "", None, 0
    async for chunk in stream:
        if chunk.usage is not None:
            ntok = chunk.usage.completion_tokens
        for c in chunk.choices:
            text += c.text
            reason = c.finish_reason or reason
    return text, reason, ntok


def test_greedy_alone_vs_busy_batch(server):
    rng = random.Random(1)
    prompts = [_prompt(rng, n) for n in (3, 12, 40, 80)]
    client = server.client()
    solo = [_solo(client, p, 20) for p in prompts]

    async def busy():
        ac = server.async_client()
        noise = [_stream_one(ac, _prompt(rng, rng.randint(2, 60)), rng.randint(5, 40), temperature=1.0,
                             seed=rng.randint(0, 1000)) for _ in range(12)]
        mine = [_stream_one(ac, p, 20) for p in prompts]
        out = await asyncio.gather(*mine, *noise)
        await ac.close()
        return [t for t, _, _ in out[:len(prompts)]]

    assert asyncio.run(busy()) == solo


def test_greedy_with_vs_without_prefix_hit(server):
    # unique prompts (cold cache), longer than the sliding window, so a hit must restore sliding-layer blocks too
    nonce = uuid.uuid4().hex[:8]
    rng = random.Random(2)
    client = server.client()
    for n_words in (30, 150):       # 150 words: longer than either model's sliding window
        prompt = f"# {nonce} {n_words}\n" + _prompt(rng, n_words)
        cold = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        warm = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
        assert warm.usage.prompt_tokens_details.cached_tokens >= 16
        assert warm.choices[0].text == cold.choices[0].text
        # a longer prompt sharing the prefix: hit on the shared blocks, same text as on a cold server state
        longer = prompt + " " + _prompt(rng, 10)
        hit = client.completions.create(model=MODEL_NAME, prompt=longer, max_tokens=16, temperature=0)
        assert hit.usage.prompt_tokens_details.cached_tokens >= 16
        again = client.completions.create(model=MODEL_NAME, prompt=longer, max_tokens=16, temperature=0)
        assert again.choices[0].text == hit.choices[0].text
    # the cached_tokens metric and the hit-rate gauge moved
    m = server.metrics()
    assert server.metric_of(m, "megakernel_prefix_cache_hit_rate") > 0
    assert server.metric_of(m, "megakernel_cached_prompt_tokens_total") > 0


def test_greedy_with_vs_without_preemption(tight_server):
    rng = random.Random(3)
    prompts = [_prompt(rng, rng.randint(20, 70)) for _ in range(16)]
    client = tight_server.client()
    solo = [_solo(client, p, 24) for p in prompts[:4]]          # alone: fits, no preemption
    before = tight_server.metric("megakernel_num_preemptions")

    async def together():
        ac = tight_server.async_client()
        out = await asyncio.gather(*[_stream_one(ac, p, 24) for p in prompts])
        await ac.close()
        return out

    out = asyncio.run(together())
    assert tight_server.metric("megakernel_num_preemptions") > before, "the KV budget did not force preemption"
    assert [t for t, _, _ in out[:4]] == solo
    assert all(r == "length" and n == 24 for _, r, n in out)
    m = tight_server.wait_idle()
    assert tight_server.metric_of(m, "megakernel_kv_blocks_in_use") == 0


@pytest.mark.slow
def test_load_64_streaming_clients(tight_server):
    rng = random.Random(4)
    distinct = [(_prompt(rng, rng.choice((4, 15, 35, 60, 75))), rng.choice((6, 12, 20, 32))) for _ in range(16)]
    client = tight_server.client()
    solo = {i: _solo(client, p, mt) for i, (p, mt) in enumerate(distinct)}
    before = tight_server.metric("megakernel_num_preemptions")
    jobs = [i % len(distinct) for i in range(64)]
    rng.shuffle(jobs)

    async def load():
        ac = tight_server.async_client()

        async def one(k, i):
            await asyncio.sleep(0.02 * (k % 8))             # staggered arrivals: requests join a running batch
            return await _stream_one(ac, *distinct[i])

        out = await asyncio.gather(*[one(k, i) for k, i in enumerate(jobs)])
        await ac.close()
        return out

    out = asyncio.run(load())
    assert len(out) == 64
    for i, (text, reason, ntok) in zip(jobs, out):
        assert reason == "length" and ntok == distinct[i][1]
        assert text == solo[i], f"request on prompt {i} differs from its solo run"
    m = tight_server.wait_idle()
    print("preemptions during the load:", tight_server.metric_of(m, "megakernel_num_preemptions") - before)
    assert tight_server.metric_of(m, "megakernel_num_preemptions") > before
    assert tight_server.metric_of(m, "megakernel_kv_blocks_in_use") == 0
    assert tight_server.metric_of(m, "megakernel_num_requests_running") == 0
    assert tight_server.metric_of(m, "megakernel_num_requests_waiting") == 0
    # still answering, and the latency histograms saw the load
    assert _solo(client, distinct[0][0], distinct[0][1]) == solo[0]
    assert tight_server.metric_of(m, "megakernel_time_to_first_token_seconds_count") >= 64
    assert tight_server.metric_of(m, "megakernel_inter_token_latency_seconds_count") > 64


def test_metrics_endpoint(server):
    import httpx

    text = httpx.get(server.url + "/metrics").text
    for name in ("megakernel_requests_total", "megakernel_prompt_tokens_total", "megakernel_generation_tokens_total",
                 "megakernel_num_requests_waiting", "megakernel_num_requests_running",
                 "megakernel_kv_cache_usage_ratio", "megakernel_prefix_cache_hit_rate",
                 "megakernel_time_to_first_token_seconds_bucket", "megakernel_inter_token_latency_seconds_bucket",
                 "megakernel_num_preemptions"):
        assert name in text, name
