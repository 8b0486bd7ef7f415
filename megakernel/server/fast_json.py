"""Request bodies parsed by orjson: the routes' JSON bodies are decoded on the event loop, under the GIL, and an
8 MB prompt took the standard library ~13-30 ms (most of the server's time per such request, session 23's profile),
in which /health and every stream waited. orjson takes half of that.

orjson is stricter than the standard library (NaN and Infinity, lone surrogates in strings): a body it refuses is
parsed again by `json.loads`, so what is accepted and the error a client gets are the standard library's. One
difference stays: an integer outside 64 bits decodes as a float. Such a request is still refused with a 400, but by
pydantic's type checks, so the message differs (a token id of 10^29 in a prompt list was "outside the vocabulary" and
is now "Input should be a valid string" for the prompt; a seed of 2^64 fails integer parsing, not the int64 range).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.routing import APIRoute

try:
    import orjson
except ImportError:          # the server extra installs it; without it bodies parse as before
    orjson = None


def loads(body: bytes) -> Any:
    """orjson's decoding, or the standard library's answer (value or JSONDecodeError) where orjson refuses."""
    if orjson is not None:
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    return json.loads(body)


class OrjsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class OrjsonRoute(APIRoute):
    """An APIRoute whose handler sees an `OrjsonRequest` (FastAPI decodes bodies through `Request.json`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            return await handler(OrjsonRequest(request.scope, request.receive, request._send))

        return route_handler
