"""fast_json.loads: orjson's answer where it accepts the body, the standard library's (value or error) elsewhere."""

import json
import math

import pytest

pytest.importorskip("fastapi")
from megakernel.server import fast_json  # noqa: E402


def test_plain_body_decodes_as_the_standard_library_does():
    body = json.dumps({"model": "m", "prompt": "word " * 1000, "max_tokens": 3, "logit_bias": {"5": -1.5}}).encode()
    assert fast_json.loads(body) == json.loads(body)


@pytest.mark.parametrize("body", [b'{"temperature": NaN}', b'{"top_p": -Infinity}', b'{"prompt": "\\ud800"}'])
def test_what_orjson_refuses_falls_back_to_the_standard_library(body):
    if fast_json.orjson is not None:
        with pytest.raises(fast_json.orjson.JSONDecodeError):
            fast_json.orjson.loads(body)
    got, want = fast_json.loads(body), json.loads(body)
    key = next(iter(want))
    assert key in got and (got[key] == want[key] or (math.isnan(got[key]) and math.isnan(want[key])))


def test_invalid_json_raises_the_standard_library_error():
    with pytest.raises(json.JSONDecodeError) as e:
        fast_json.loads(b'{"model": "m",')
    assert e.value.pos == 14


def test_routes_decode_through_orjson_request(monkeypatch):
    from fastapi import APIRouter, FastAPI
    from fastapi.testclient import TestClient

    seen = []
    router = APIRouter(route_class=fast_json.OrjsonRoute)

    @router.post("/echo")
    async def echo(body: dict):
        return body

    orig = fast_json.OrjsonRequest.json

    async def spy(self):
        seen.append(type(self).__name__)
        return await orig(self)

    app = FastAPI()
    app.include_router(router)
    monkeypatch.setattr(fast_json.OrjsonRequest, "json", spy)
    r = TestClient(app).post("/echo", json={"a": [1, 2]})
    assert r.status_code == 200 and r.json() == {"a": [1, 2]} and seen == ["OrjsonRequest"]
