"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

Requests are validated up front (pydantic models that forbid unknown fields, then the checks that need the model:
vocabulary, context length, tool schemas), so every client error is a 4xx in OpenAI's error shape:
`{"error": {"message", "type", "param", "code"}}`. Generation runs on the AsyncEngine's thread; a request whose
client goes away (streaming or not) is aborted and its KV blocks freed.

Where things live: the endpoints in completions.py and chat_endpoint.py (chat rendering in chat.py), request
checks and sampling parameters in request_params.py, errors in errors.py, auth in auth.py, SSE framing in sse.py,
stream deltas and disconnects in streaming.py, logprobs in logprobs.py, usage and finish reasons in responses.py,
the OpenAPI schema in openapi.py, shared state (tokenizers, prep threads) in state.py, body decoding in
fast_json.py.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from megakernel.server.async_engine import AsyncEngine
from megakernel.server.auth import require_api_key
from megakernel.server import chat_endpoint, completions as completions_endpoint
from megakernel.server.errors import APIError, error_response, validation_message
from megakernel.server.fast_json import OrjsonRoute
from megakernel.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from megakernel.server.middleware import MAX_BODY_BYTES, RequestContext
from megakernel.server.openapi import patch_openapi
from megakernel.server.protocol import ChatCompletionRequest, CompletionRequest
from megakernel.server.state import ServerConfig, ServerState

log = logging.getLogger("megakernel.server")


def create_app(engine: AsyncEngine, served_model_names: list[str], api_key: str | None = None,
               metrics: ServerMetrics | None = None, *, chat_template: str | None = None,
               allowed_origins: list[str] | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> RequestContext:
    metrics = metrics or engine.metrics or ServerMetrics(served_model_names[0])
    engine.metrics = metrics
    state = ServerState(engine, ServerConfig(list(served_model_names), api_key, int(time.time())), metrics,
                        chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine._thread.is_alive() and not engine._thread.ident:
            engine.start()
        try:
            yield
        finally:
            engine.shutdown()
            state.prep.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="megakernel", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible server for cohere2_moe models")
    app.state.mk = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(raw: Request, e: RequestValidationError):
        msg, param = validation_message(list(e.errors()))
        ctype = raw.headers.get("content-type", "")
        if param is None and raw.method == "POST" and "json" not in ctype:
            msg = f"{msg}; send the body as JSON with 'Content-Type: application/json' (got {ctype or 'none'!r})"
        return error_response(400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        msg = e.detail if isinstance(e.detail, str) else json.dumps(e.detail)
        return error_response(e.status_code, msg, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception):
        log.exception("internal error")
        return error_response(500, f"internal server error: {type(e).__name__}: {e}")

    router = APIRouter(dependencies=[Depends(require_api_key)], route_class=OrjsonRoute)

    @router.api_route("/v1/models", methods=["GET", "HEAD"])
    async def list_models(raw: Request):
        return {"object": "list", "data": [_model_card(state, n) for n in state.cfg.served_model_names]}

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, raw: Request):
        if model not in state.cfg.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        return _model_card(state, model)

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await completions_endpoint.completions(state, req, raw)

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await chat_endpoint.chat_completions(state, req, raw)

    app.include_router(router)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not engine.alive:
            return error_response(503, "the engine is not running", type="server_error")
        return {"status": "ok"}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus():
        return Response(metrics.render(engine.snapshot), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": _version()}

    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    patch_openapi(app, state)
    return RequestContext(app, metrics, max_body_bytes)


def _version() -> str:
    try:
        from megakernel import __version__

        return __version__
    except Exception:
        return "0"


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": state.cfg.created, "owned_by": "megakernel",
            "root": str(getattr(state.engine.engine, "model_path", None) or name),
            "max_model_len": state.max_model_len}
