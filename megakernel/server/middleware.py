"""The ASGI layer around the app: a request id on every response, a cap on body size, and HTTP counts.

Pure ASGI (no BaseHTTPMiddleware: it breaks disconnect detection of streaming responses).
"""

from __future__ import annotations

import json
import uuid

from megakernel.server.metrics import ServerMetrics

MAX_BODY_BYTES = 32 << 20        # bodies past this get a 413 before anything parses them

KNOWN = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"}


def _endpoint(path: str) -> str:
    return path if path in KNOWN else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class RequestContext:
    """Tags every response with `x-request-id` (the client's own, or a new one), answers bodies larger than
    `max_body_bytes` with 413 (by Content-Length, or while a chunked body arrives), and counts responses by
    endpoint and status."""

    def __init__(self, app, metrics: ServerMetrics, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.state = app.state

    def __getattr__(self, name):   # behave like the FastAPI app for tests and tooling (openapi(), routes, ...)
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        status = {"code": 0}

        async def send_(msg):
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
                msg = dict(msg, headers=[*msg.get("headers", []), (b"x-request-id", rid.encode("latin-1"))])
            await send(msg)

        try:
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                return await self._too_large(send_)
            received = {"n": 0}

            async def receive_():
                msg = await receive()
                if msg["type"] == "http.request":
                    received["n"] += len(msg.get("body", b""))
                    if received["n"] > self.max_body_bytes:
                        raise _BodyTooLarge
                return msg

            try:
                await self.app(scope, receive_, send_)
            except _BodyTooLarge:
                if not status["code"]:
                    await self._too_large(send_)
        finally:
            self.metrics.http_requests.labels(_endpoint(scope.get("path", "")), str(status["code"] or 499)).inc()

    async def _too_large(self, send) -> None:
        body = json.dumps({"error": {"message": f"The request body is larger than {self.max_body_bytes} bytes",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass
