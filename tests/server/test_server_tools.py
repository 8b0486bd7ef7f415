"""North format: rendering (chat template, tools, tool_choice, tool results), parsing of reasoning and
<|START_ACTION|> tool calls (crafted text, both parser back-ends, streamed char by char), and the end-to-end
tool-calling path through a live server with the official client (streamed tool-call deltas)."""

from __future__ import annotations

import json

import pytest

from server_harness import MODEL_NAME, first_streamed_call
from megakernel.server import chat as chatmod
from megakernel.server.protocol import ChatCompletionRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

CALLS_TEXT = ('I should look up both.<|END_THINKING|><|START_ACTION|>[{"tool_call_id": "0", "tool_name": '
              '"get_weather", "parameters": {"city": "Paris", "unit": "C"}}, {"tool_call_id": "1", "tool_name": '
              '"get_time", "parameters": {}}]<|END_ACTION|>')
ANSWER_TEXT = "The user greets.<|END_THINKING|><|START_TEXT|>Hello! How can I help?<|END_TEXT|>"

BACKENDS = [pytest.param(True, id="melody"), pytest.param(False, id="python")]


def _parse(text: str, use_melody: bool, chunk: int | None = None, tools=True, in_reasoning=True):
    p = chatmod.ChatParser(tools, in_reasoning, use_melody=use_melody)
    if use_melody and p.backend != "cohere-melody":
        pytest.skip("cohere-melody not installed")
    deltas = []
    if chunk is None:
        deltas.append(p.feed(text))
    else:
        for i in range(0, len(text), chunk):
            deltas.append(p.feed(text[i:i + chunk]))
    deltas.append(p.finish())
    return p, deltas


@pytest.mark.parametrize("use_melody", BACKENDS)
@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_parse_tool_calls(use_melody, chunk):
    p, deltas = _parse(CALLS_TEXT, use_melody, chunk)
    assert p.reasoning == "I should look up both."
    assert p.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [("get_weather", {"city": "Paris", "unit": "C"}),
                                                                    ("get_time", {})]
    assert len({c.id for c in p.calls}) == 2 and all(c.id.startswith("call_") for c in p.calls)
    # the deltas rebuild the calls: the first delta of a call has id and name, then argument fragments
    rebuilt: dict[int, dict] = {}
    for d in deltas:
        for t in d.tool_calls:
            if t.id is not None:
                assert t.index not in rebuilt and t.name
                rebuilt[t.index] = {"id": t.id, "name": t.name, "arguments": t.arguments}
            else:
                rebuilt[t.index]["arguments"] += t.arguments
    assert [(r["id"], r["name"], json.loads(r["arguments"])) for r in rebuilt.values()] == \
        [(c.id, c.name, json.loads(c.arguments)) for c in p.calls]
    if use_melody and chunk == 1:   # streamed incrementally, not in one piece at the end
        assert sum(1 for d in deltas for t in d.tool_calls if t.id is None and t.arguments) > 3


@pytest.mark.parametrize("use_melody", BACKENDS)
@pytest.mark.parametrize("chunk", [None, 1])
def test_parse_reasoning_and_answer(use_melody, chunk):
    p, _ = _parse(ANSWER_TEXT, use_melody, chunk)
    assert (p.reasoning, p.content, p.calls) == ("The user greets.", "Hello! How can I help?", [])
    p, _ = _parse("<|START_TEXT|>Hi<|END_TEXT|>", use_melody, chunk, in_reasoning=False)
    assert (p.reasoning, p.content) == ("", "Hi")


@pytest.mark.parametrize("use_melody", BACKENDS)
def test_parse_garbage_never_raises(use_melody):
    import random

    rng = random.Random(0)
    pieces = ["<|START_THINKING|>", "<|END_THINKING|>", "<|START_TEXT|>", "<|END_TEXT|>", "<|START_ACTION|>",
              "<|END_ACTION|>", "[", "{", '"', ":", "}", "]", " ", "ab", "tool_name", "parameters", "\\", "é"]
    for _ in range(100):
        text = "".join(rng.choice(pieces) for _ in range(30))
        p, _ = _parse(text, use_melody, 3)
        for c in p.calls:
            assert isinstance(c.arguments, str) and c.name


def _tok(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def _req(**kw) -> ChatCompletionRequest:
    kw.setdefault("model", "m")
    kw.setdefault("messages", [{"role": "user", "content": "Weather in Paris?"}])
    return ChatCompletionRequest.model_validate(kw)


def test_render_tools_and_choice(model_path):
    tok = _tok(model_path)
    plain = chatmod.render_chat(tok, _req())
    assert plain.prompt.endswith("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>")
    assert plain.in_reasoning and not plain.tools_enabled and plain.constraint is None
    auto = chatmod.render_chat(tok, _req(tools=[WEATHER, TIME]))
    assert "# Available Tools" in auto.prompt and '"name": "get_weather"' in auto.prompt and auto.tools_enabled
    none = chatmod.render_chat(tok, _req(tools=[WEATHER], tool_choice="none"))
    assert "get_weather" not in none.prompt and not none.tools_enabled
    assert auto.constraint is None and auto.tool_names == {"get_weather", "get_time"}
    # forced choices: free reasoning, then the call decoded under a grammar naming the allowed tools
    req = chatmod.render_chat(tok, _req(tools=[WEATHER, TIME], tool_choice="required"))
    assert req.prompt == auto.prompt
    grammar = req.constraint.spec.grammar
    assert grammar.startswith("start: THINK <|END_THINKING|> calls")
    assert '"\\"get_weather\\", \\"parameters\\": "' in grammar and "get_time" in grammar
    named = chatmod.render_chat(tok, _req(tools=[WEATHER, TIME],
                                          tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert named.prompt == auto.prompt
    assert "get_time" in named.constraint.spec.grammar and "get_weather" not in named.constraint.spec.grammar


def test_render_tool_results(model_path):
    tok = _tok(model_path)
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "reasoning_content": "look it up", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    r = chatmod.render_chat(tok, _req(messages=msgs, tools=[WEATHER]))
    assert '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}]' \
           '<|END_ACTION|>' in r.prompt
    assert "<|START_TOOL_RESULT|>" in r.prompt and "temp" in r.prompt and "21" in r.prompt
    assert "<|START_THINKING|>look it up<|END_THINKING|>" in r.prompt


@pytest.mark.parametrize("bad", [
    {"type": "function", "function": {"name": "bad name!", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": 3}}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strng"}}}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}},
    {"type": "retrieval", "function": {"name": "f"}},
])
def test_invalid_tool_schema_is_400(server, bad):
    import httpx

    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "tools": [bad], "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] and err["param"].startswith("tools")


# ---- end to end: scripted model text through the real app, HTTP and the official client ------------------------
def _script(prompt: str) -> str:
    if "<|START_TOOL_RESULT|>" in prompt:
        return "I have the data.<|END_THINKING|><|START_TEXT|>It is 21 degrees in Paris.<|END_TEXT|>"
    if "Force a call" in prompt and "# Available Tools" in prompt:      # the forced tool_choice test
        return 'Calling.<|END_THINKING|><|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", ' \
               '"parameters": {"city": "Rome"}}]<|END_ACTION|>'
    if "# Available Tools" in prompt:
        return CALLS_TEXT
    return ANSWER_TEXT


@pytest.fixture(scope="module")
def scripted(model_path):
    from scripted_engine import InProcessServer, ScriptedEngine

    engine = ScriptedEngine(_tok(model_path), _script, step_delay=0.01)   # a token every 10 ms, like a model
    srv = InProcessServer(engine)
    srv.engine = engine
    yield srv
    srv.stop()


def test_e2e_tool_calls_non_stream(scripted):
    c = scripted.client()
    r = c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Paris weather + time?"}],
                                  tools=[WEATHER, TIME])
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    assert ch.message.reasoning_content == "I should look up both."
    calls = ch.message.tool_calls
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {})]
    assert all(t.type == "function" and t.id.startswith("call_") for t in calls)
    # send the results back: rendered as a tool-result turn, the model answers in text
    msgs = [{"role": "user", "content": "Paris weather + time?"}, ch.message.model_dump(exclude_none=True)]
    msgs += [{"role": "tool", "tool_call_id": t.id, "content": json.dumps({"ok": t.function.name})} for t in calls]
    r2 = c.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER, TIME])
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.content == "It is 21 degrees in Paris."
    last_prompt = scripted.engine.prompts[-1]
    assert '"tool_name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}' in last_prompt
    results = last_prompt.split("<|START_TOOL_RESULT|>", 1)[1]
    assert "get_weather" in results and "get_time" in results


def test_e2e_tool_calls_stream(scripted):
    c = scripted.client()
    stream = c.chat.completions.create(model="scripted", stream=True, tools=[WEATHER, TIME],
                                       messages=[{"role": "user", "content": "Paris weather + time?"}])
    calls: dict[int, dict] = {}
    reasoning = ""
    finish = None
    arg_deltas = 0
    for chunk in stream:
        for ch in chunk.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            finish = ch.finish_reason or finish
            for t in ch.delta.tool_calls or []:
                if t.id:
                    assert t.index not in calls and t.function.name and t.type == "function"
                    calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": t.function.arguments or ""}
                else:
                    assert t.index in calls and not (t.function.name or "")
                    calls[t.index]["arguments"] += t.function.arguments or ""
                    arg_deltas += 1
    assert finish == "tool_calls"
    assert reasoning == "I should look up both."
    assert [(v["name"], json.loads(v["arguments"])) for v in calls.values()] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {})]
    assert arg_deltas >= 3          # arguments arrive incrementally


def test_e2e_tool_choice_forcing(scripted):
    c = scripted.client()
    msgs = [{"role": "user", "content": "Force a call"}]
    named = c.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER, TIME],
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    t = named.choices[0].message.tool_calls
    assert [(x.function.name, json.loads(x.function.arguments)) for x in t] == [("get_weather", {"city": "Rome"})]
    req = c.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER, TIME], tool_choice="required")
    assert [x.function.name for x in req.choices[0].message.tool_calls] == ["get_weather"]
    assert req.choices[0].finish_reason == "tool_calls"
    none = c.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER, TIME], tool_choice="none")
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == "Hello! How can I help?"
    one = c.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [x.function.name for x in one.choices[0].message.tool_calls] == ["get_weather"]


def test_e2e_tool_choice_real_model(server):
    """The real model through the live server: a named tool_choice streams a tool call with that name."""
    c = server.client()
    stream = c.chat.completions.create(model=MODEL_NAME, stream=True, max_tokens=80, temperature=0,
                                       messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    first = None
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for t in ch.delta.tool_calls or []:
                if first is None:
                    first = t
    assert first is not None and first.id.startswith("call_") and first.function.name == "get_weather"
    assert finish in ("tool_calls", "length")


def test_e2e_trained_model_tool_round_trip(server, model_path):
    """With the trained embedded model (north_nano): a tool call from the model itself, non-streamed and streamed
    (deltas rebuild the same call), then the tool result rendered back and answered in text."""
    c = server.client()
    tools = [WEATHER]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=tools, temperature=0, max_tokens=120)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    stream = c.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=tools, temperature=0, max_tokens=120,
                                       stream=True)
    name, arguments, n_deltas, finish = first_streamed_call(stream)
    assert finish == "tool_calls" and name == "get_weather"
    assert json.loads(arguments) == args and n_deltas > 2
    msgs.append(ch.message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})})
    r2 = c.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=tools, temperature=0, max_tokens=120)
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
