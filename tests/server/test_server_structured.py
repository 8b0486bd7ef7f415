"""Structured outputs through the live server and the official client, on the embedded model: response_format
json_schema / json_object answers validate (jsonschema) over 20+ prompts; forced tool calls (tool_choice
"required" or named) name a given tool and their arguments validate against its schema; with "auto" a call to a
name that is not in `tools` is not returned as a tool call (issue 14, item 2)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from server_harness import MODEL_NAME, first_streamed_call

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["answer"], "additionalProperties": False}
CODE = {"type": "object", "properties": {"language": {"type": "string", "enum": ["python", "c", "rust"]},
                                         "lines": {"type": "integer", "minimum": 1, "maximum": 999},
                                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                  "maxItems": 3}},
        "required": ["language", "lines", "tags"], "additionalProperties": False}
# Strings and numbers are bounded (maxLength, enum, integer ranges) and no other keys are allowed (as OpenAI's strict
# mode requires): north-nano was never trained to answer in JSON, and an unbounded string, fraction or extra key is
# one it may never close before max_tokens. The schema, not the model, guarantees the shape.
CASES = [(PERSON, p) for p in ("Give me a person as JSON with name and age.", "Describe Alice, 30, as JSON.",
                               "Who wrote Python? Answer as a person record.", "Make up a user profile.",
                               "Return the oldest person you know.", "name and age of a child",
                               "JSON for Bob who is 41.")] + \
        [(ANSWER, p) for p in ("Is 7 a prime number?", "Is Paris in France?", "Can a list hold duplicates?",
                               "Is the sky green?", "Does Python have tuples?", "Is 0 an even number?",
                               "Is water wet?")] + \
        [(CODE, p) for p in ("Describe a hello world program.", "Summarise a fibonacci function.",
                             "What language is best for kernels?", "Tag a sorting function.",
                             "Describe def add(a, b): return a + b", "Describe a JSON parser.",
                             "Describe an HTTP server.")]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time of a timezone",
                                         "parameters": {"type": "object", "properties": {
                                             "timezone": {"type": "string", "maxLength": 24}},
                                             "required": ["timezone"]}}}
TOOL_PROMPTS = ["What is the weather in Paris?", "Is it raining in Tokyo?", "Weather in Berlin, in F please.",
                "What time is it in London?", "Tell me the time in Asia/Tokyo.", "How warm is it in Rome?",
                "Check the weather for Oslo.", "What's the local time in New York?", "Is it cold in Moscow?",
                "Time in Sydney?", "Forecast for Madrid", "Current time, Europe/Paris"]


@pytest.mark.slow
def test_json_schema_answers_validate(client):
    ok = 0
    for schema, prompt in CASES:
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=160,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                    "strict": True}})
        ch = r.choices[0]
        assert ch.finish_reason == "stop", (prompt, ch)
        jsonschema.validate(json.loads(ch.message.content), schema)
        ok += 1
    assert ok == len(CASES) >= 20
    print(f"json_schema: {ok}/{len(CASES)} answers validate")


def test_json_schema_streamed_and_sampled(client):
    schema, prompt = CASES[0]
    text, finish = "", None
    for chunk in client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], temperature=1.0, seed=3,
            max_tokens=160, stream=True, n=2,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}):
        for c in chunk.choices:
            if c.index == 0:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_json_object(client):
    for prompt in ("Give me any JSON object.", "Configuration as JSON"):
        r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                           temperature=0, max_tokens=200, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:       # an unbounded object may run to max_tokens: what came is still a JSON object's prefix
            assert r.choices[0].message.content.startswith("{")


def _check_calls(calls, tools):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for c in calls:
        assert c.function.name in schemas, c
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


def test_tool_choice_required_names_a_tool_with_valid_arguments(client):
    for prompt in TOOL_PROMPTS:
        r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                           tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                                           max_tokens=160)
        assert r.choices[0].finish_reason == "tool_calls", (prompt, r.choices[0])
        _check_calls(r.choices[0].message.tool_calls, [WEATHER, TIME])


@pytest.mark.parametrize("tool", [WEATHER, TIME], ids=["get_weather", "get_time"])
def test_named_tool_choice_has_its_required_arguments(client, tool):
    name = tool["function"]["name"]
    for prompt in TOOL_PROMPTS[:6]:
        r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                           tools=[WEATHER, TIME], temperature=0, max_tokens=160,
                                           tool_choice={"type": "function", "function": {"name": name}})
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == [name]
        _check_calls(calls, [tool])


def test_forced_tool_call_streamed(client):
    name, args, _, finish = first_streamed_call(client.chat.completions.create(
        model=MODEL_NAME, stream=True, temperature=0, max_tokens=160, tools=[WEATHER, TIME], tool_choice="required",
        messages=[{"role": "user", "content": TOOL_PROMPTS[0]}]))
    assert finish == "tool_calls" and name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(args), {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"])


def test_tool_call_or_json_answer_under_auto(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": TOOL_PROMPTS[0]}], tools=[WEATHER], temperature=0,
        max_tokens=160, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    ch = r.choices[0]
    if ch.message.tool_calls:
        _check_calls(ch.message.tool_calls, [WEATHER])
    else:
        jsonschema.validate(json.loads(ch.message.content), ANSWER)


def test_strict_tool_needs_a_forced_choice(server):
    import httpx

    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "tools": [strict], "max_tokens": 60}
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.function.strict"
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60,
                   json={**body, "tool_choice": "required", "max_tokens": 160})
    assert r.status_code == 200, r.text


# ---- auto: the server checks names (scripted model text, so the bad name is certain) -------------------------
def _script(prompt: str) -> str:
    return ('I will call it.<|END_THINKING|><|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_call_id", '
            '"parameters": {}}, {"tool_call_id": "1", "tool_name": "get_weather", "parameters": {"city": "Oslo"}}]'
            '<|END_ACTION|>')


@pytest.fixture(scope="module")
def scripted(model_path):
    from transformers import AutoTokenizer

    from scripted_engine import InProcessServer, ScriptedEngine

    srv = InProcessServer(ScriptedEngine(AutoTokenizer.from_pretrained(str(model_path)), _script, step_delay=0.002))
    yield srv
    srv.stop()


def test_auto_drops_calls_to_unknown_tools(scripted):
    c = scripted.client()
    kw = dict(model="scripted", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER])
    r = c.chat.completions.create(**kw)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    names = [t.function.name for ch in c.chat.completions.create(stream=True, **kw) for c0 in ch.choices
             for t in c0.delta.tool_calls or [] if t.function.name]
    assert names == ["get_weather"]
