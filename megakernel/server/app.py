"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

Requests are validated up front (pydantic models that forbid unknown fields, then the checks that need the model:
vocabulary, context length, tool schemas), so every client error is a 4xx in OpenAI's error shape:
`{"error": {"message", "type", "param", "code"}}`. Generation runs on the AsyncEngine's thread; a request whose
client goes away (streaming or not) is aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from megakernel.engine.outputs import CompletionOutput, RequestOutput
from megakernel.engine.sampling_params import SamplingParams
from megakernel.errors import RequestError
from megakernel.north_format import reasoning_ban
from megakernel.server import chat as chatmod
from megakernel.server.async_engine import AsyncEngine, EngineDeadError, RequestFailed
from megakernel.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from megakernel.server.middleware import MAX_BODY_BYTES, RequestContext
from megakernel.server.protocol import ChatCompletionRequest, CompletionRequest, MAX_N, malformed_text

log = logging.getLogger("megakernel.server")

SEED_MOD = 2**63 - MAX_N - 1
MAX_SEQS_PER_REQUEST = 256


# ---- errors ----------------------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")


_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
                404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                422: "invalid_request_error", 500: "server_error", 503: "server_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, type), status_code=status, headers=headers)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    if not errors:
        return "invalid request", None
    # Prefer the most specific error: the one with the longest location (union members report on the same path).
    e = max(errors, key=lambda err: len(err.get("loc", ())))
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # drop pydantic's union-member tags such as 'str', 'list[int]', 'function-after[...]' from the path
    loc = [x for x in loc if not (x.startswith(("list[", "function-", "tagged-union[", "nullable[", "literal[")) or
                                  x in ("str", "int", "float", "bool", "dict", "list", "none", "NamedToolChoice"))]
    if len(loc) >= 3 and loc[0] == "messages" and loc[2] in ("system", "developer", "user", "assistant", "tool"):
        del loc[2]         # the discriminated union's tag
    if len(loc) >= 2 and loc[0] == "response_format" and loc[1] in ("text", "json_object", "json_schema"):
        del loc[1]
    param = ".".join(loc) or None
    typ = e.get("type", "")
    if typ == "json_invalid":
        ctx = e.get("ctx", {}) or {}
        return f"Malformed JSON body: {ctx.get('error', e.get('msg', ''))}", None
    if typ == "missing" and not loc:
        return "The request body is missing (expected a JSON object)", None
    if typ == "extra_forbidden":
        return f"Unsupported field '{param}': this server does not implement it", param
    if typ == "model_attributes_type" and not loc:
        return "The request body must be a JSON object", None
    msg = e.get("msg", "invalid value")
    return (f"Invalid value for '{param}': {msg}" if param else msg), param


# ---- state -----------------------------------------------------------------------------------------------------
@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    created: int = 0


PREP_THREADS = 2


class _State:
    def __init__(self, engine: AsyncEngine, cfg: ServerConfig, metrics: ServerMetrics,
                 chat_template: str | None = None) -> None:
        self.engine = engine
        self.cfg = cfg
        self.metrics = metrics
        eng = engine.engine
        tok = engine.tokenizer
        path = getattr(eng, "model_path", None)
        # Each thread that touches a tokenizer has its own copy (a Rust tokenizer shared across threads can fail
        # with "Already borrowed"): the engine thread decodes with the engine's, the event loop decodes logprob
        # tokens with `tokenizer`, and the prep threads render and tokenise requests off the event loop, so a
        # huge prompt never stalls other requests (or /health).
        self.tokenizer = _clone_tokenizer(tok, path)
        if self.tokenizer is not None:
            if chat_template is not None:
                self.tokenizer.chat_template = chat_template
            self.tokenizer.model_max_length = 1 << 62     # we check lengths ourselves: no transformers warning
        clones = [_clone_tokenizer(self.tokenizer, path) for _ in range(PREP_THREADS)]
        self._local = threading.local()
        self.prep = ThreadPoolExecutor(PREP_THREADS, "megakernel-prep", initializer=self._init_prep, initargs=(clones,))
        self.grammar = getattr(eng, "grammar", None)    # structured outputs; None: not supported by this engine
        self.vocab_size = int(eng.config.vocab_size)
        self.eos_ids = set(getattr(eng, "eos_token_ids", ()) or ())
        self.specials = chatmod.special_strings_to_strip(self.tokenizer)
        self._decode_cache: dict[int, str] = {}

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def _init_prep(self, clones: list) -> None:
        self._local.tok = clones.pop()
        try:    # a lower priority for prep threads: a CPU-bound tokenisation must not starve the event loop
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass

    @property
    def worker_tokenizer(self):
        """The calling prep thread's tokenizer."""
        return self._local.tok

    async def off_loop(self, fn, *args):
        """Run fn(*args) on a prep thread (rendering, tokenising, grammar compiling) and await its result."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)

    def token_str(self, tid: int, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{tid}"
        s = self._decode_cache.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid], skip_special_tokens=False) if self.tokenizer is not None else \
                f"token_id:{tid}"
            if len(self._decode_cache) < 1_000_000:
                self._decode_cache[tid] = s
        return s


def _clone_tokenizer(tok, path):
    if tok is None:
        return None
    try:
        return copy.deepcopy(tok)
    except Exception:
        if path is not None:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(path))
        return tok


# ---- app -------------------------------------------------------------------------------------------------------
def create_app(engine: AsyncEngine, served_model_names: list[str], api_key: str | None = None,
               metrics: ServerMetrics | None = None, *, chat_template: str | None = None,
               allowed_origins: list[str] | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    metrics = metrics or engine.metrics or ServerMetrics(served_model_names[0])
    engine.metrics = metrics
    state = _State(engine, ServerConfig(list(served_model_names), api_key, int(time.time())), metrics,
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
        msg, param = _validation_message(list(e.errors()))
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

    router = APIRouter(dependencies=[Depends(_auth)])

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
        return await _completions(state, req, raw)

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await _chat(state, req, raw)

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
    _patch_openapi(app, state)
    return RequestContext(app, metrics, max_body_bytes)


def _version() -> str:
    try:
        from megakernel import __version__

        return __version__
    except Exception:
        return "0"


def _patch_openapi(app: FastAPI, state: _State) -> None:
    """Document the served model names and the Bearer auth in the OpenAPI schema."""
    base = app.openapi

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        schema = base()
        comps = schema.get("components", {}).get("schemas", {})
        room = max(1, state.max_model_len - 1)
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            props = comps.get(name, {}).get("properties", {})
            if "model" in props:   # the names this server answers to (others get a 404)
                props["model"] = {"type": "string", "enum": list(state.cfg.served_model_names), "title": "Model"}
            for field in ("max_tokens", "max_completion_tokens"):
                for alt in props.get(field, {}).get("anyOf", []):
                    if alt.get("type") == "integer":
                        alt["maximum"] = room
        for ops in schema.get("paths", {}).values():    # GET /v1/models/{model}: the served names
            for op in ops.values():
                for prm in op.get("parameters", []):
                    if prm.get("name") == "model" and prm.get("in") == "path":
                        prm["schema"] = {"type": "string", "enum": list(state.cfg.served_model_names)}
        prompt = comps.get("CompletionRequest", {}).get("properties", {}).get("prompt", {})
        for alt in prompt.get("anyOf", []):
            if alt.get("type") != "array":
                continue
            items = alt.get("items", {})
            if items.get("type") == "array":
                items = items.get("items", {})
                alt["items"]["minItems"] = 1
            if items.get("type") == "integer":
                items.update(minimum=0, maximum=state.vocab_size - 1)
            alt["minItems"] = 1
        if state.cfg.api_key:
            schema.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
                "type": "http", "scheme": "bearer"}
            for path, ops in schema.get("paths", {}).items():
                if path.startswith("/v1/"):
                    for op in ops.values():
                        op["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


async def _auth(raw: Request) -> None:
    state: _State = raw.app.state.mk
    key = state.cfg.api_key
    if not key:
        return
    header = raw.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect API key provided." if header else
                       "You didn't provide an API key. Pass it as 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")


def _model_card(state: _State, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": state.cfg.created, "owned_by": "megakernel",
            "root": str(getattr(state.engine.engine, "model_path", None) or name),
            "max_model_len": state.max_model_len}


def _check_model(state: _State, req) -> None:
    bad = malformed_text(req)
    if bad is not None:
        raise APIError(400, f"Invalid text in '{bad}': it is not valid Unicode (a lone UTF-16 surrogate?)", bad)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    model = req.model
    if model not in state.cfg.served_model_names:
        raise APIError(404, f"The model `{model}` does not exist. Served: {', '.join(state.cfg.served_model_names)}",
                       "model", "model_not_found")


# ---- shared request handling -----------------------------------------------------------------------------------
def _sampling_params(state: _State, req, *, max_tokens: int | None, logprobs: int | None,
                     skip_special_tokens: bool) -> SamplingParams:
    bias: dict[int, float] = {}
    for k, v in (req.logit_bias or {}).items():
        try:
            tid = int(k)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
        if not 0 <= tid < state.vocab_size:
            raise APIError(400, f"logit_bias token id {tid} is outside the vocabulary (size {state.vocab_size})",
                           "logit_bias")
        if not -100 <= v <= 100:
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {v}", "logit_bias")
        bias[tid] = float(v)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "stop strings must not be empty", "stop")
    if stop and state.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so stop strings cannot be matched; use stop_token_ids",
                       "stop")
    stop_ids = list(req.stop_token_ids or [])
    bad = [t for t in stop_ids if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids: token id {bad[0]} is outside the vocabulary", "stop_token_ids")
    seed = None if req.seed is None else req.seed % SEED_MOD
    try:
        return SamplingParams(
            n=req.n or 1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0,
            seed=seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens or 0,
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=bool(req.ignore_eos),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias,
            logprobs=logprobs,
            skip_special_tokens=skip_special_tokens,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
        )
    except RequestError as e:
        raise APIError(400, str(e), str(e).split(" ", 1)[0]) from None


def _check_prompt_ids(state: _State, ids: list[int], param: str) -> None:
    if not ids:
        raise APIError(400, "The prompt is empty", param)
    if len(ids) >= state.max_model_len:       # (text prompts are cut at max_model_len tokens)
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, your "
                       f"prompt has {len(ids) if len(ids) > state.max_model_len else 'at least ' + str(len(ids))} "
                       f"tokens (at least one token must be left for the completion). Please reduce the length of "
                       f"the prompt.", param, "context_length_exceeded")
    bad = next((t for t in ids if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"prompt token id {bad} is outside the vocabulary (size {state.vocab_size})", param)


def _resolve_max_tokens(state: _State, n_prompt: int, max_tokens: int | None, param: str) -> int:
    room = state.max_model_len - n_prompt
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, you "
                       f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the "
                       f"completion). Please reduce the prompt or the completion length.", param,
                       "context_length_exceeded")
    return max_tokens


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _visible_tokens(state: _State, o: CompletionOutput, params: SamplingParams) -> int:
    """How many of o's tokens belong to the answer (a final EOS or stop token is not shown)."""
    n = len(o.token_ids)
    if n and o.finish_reason == "stop" and (o.stop_reason is None or isinstance(o.stop_reason, int)) and \
            (o.token_ids[-1] in state.eos_ids or o.token_ids[-1] in params.stop_token_ids):
        return n - 1
    return n


class _Tracker:
    """What of one choice's cumulative output has been sent: text (with stop-string hold-back) and tokens."""

    def __init__(self, holdback: int, specials: list[str] | None) -> None:
        self.holdback = holdback
        self.specials = specials
        self.sent_text = 0
        self.sent_tokens = 0

    def text_delta(self, o: CompletionOutput, final: bool) -> str:
        text = chatmod.strip_specials(o.text, self.specials) if self.specials else o.text
        upto = len(text) if final else len(text) - self.holdback
        if not final:
            while upto > self.sent_text and text[upto - 1] == "\ufffd":   # an incomplete UTF-8 sequence
                upto -= 1
        if upto <= self.sent_text:
            return ""
        out = text[self.sent_text:upto]
        self.sent_text = upto
        return out

    def token_delta(self, o: CompletionOutput, visible: int) -> tuple[list[int], list]:
        upto = visible
        ids = o.token_ids[self.sent_tokens:upto]
        lps = (o.logprobs or [])[self.sent_tokens:upto]
        self.sent_tokens = max(self.sent_tokens, upto)
        return ids, lps


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' snapshot streams; closing the merge aborts every request."""
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _collect_finals(raw: Request, gens) -> dict[int, RequestOutput] | None:
    """The final output of each generator (by index), or None if the client disconnected first (which aborts
    the requests). Engine failures become OpenAI-shaped HTTP errors."""

    async def collect() -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in _merge(gens):
            if out.finished:
                finals[i] = out
        return finals

    try:
        return await _until_disconnect(raw, collect())
    except (RequestError, EngineDeadError, RequestFailed) as e:
        raise _engine_error(e) from None


async def _until_disconnect(raw: Request, coro):
    """Run coro; if the client disconnects first, cancel it (which aborts its requests) and return None."""
    task = asyncio.ensure_future(coro)

    async def listen() -> None:
        while True:
            msg = await raw.receive()
            if msg["type"] == "http.disconnect":
                return

    listener = asyncio.ensure_future(listen())
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        listener.cancel()
        raise
    if task in done:
        listener.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - cancelled on purpose
        pass
    return None


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, RequestError):
        return APIError(400, str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), type="server_error")
    if isinstance(e, RequestFailed):
        return APIError(e.status, str(e), type="server_error")
    return APIError(500, f"{type(e).__name__}: {e}", type="server_error")


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _stream_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


SSE_DONE = "data: [DONE]\n\n"


def _stream_error_end(e: BaseException) -> str:
    """How a stream that failed after its headers were sent ends: an error event, then [DONE]."""
    err = _engine_error(e)
    return _sse(error_body(err.status, err.message, err.param, err.code, err.type)) + SSE_DONE


# ---- /v1/completions -------------------------------------------------------------------------------------------
def _completion_logprobs(state: _State, ids: list[int], lps: list, offset: int, n_top: int,
                         as_ids: bool = False) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for tid, lp in zip(ids, lps):
        s = state.token_str(tid, as_ids)
        tokens.append(s)
        token_lps.append(lp.logprob)
        tops.append({state.token_str(t, as_ids): v for t, v in list(lp.top.items())[:n_top]} if n_top else None)
        offsets.append(pos)
        pos += len(state.token_str(tid))
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def _completions(state: _State, req: CompletionRequest, raw: Request):
    _check_model(state, req)
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise APIError(400, "best_of != n is not supported (no server-side ranking)", "best_of")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
    p = req.prompt
    if isinstance(p, str):
        prompts: list[Any] = [p]
    elif p and isinstance(p[0], list):
        prompts = list(p)
    elif p and isinstance(p[0], int):
        prompts = [list(p)]
    else:
        prompts = list(p)
    if not prompts:
        raise APIError(400, "The prompt is empty", "prompt")
    if len(prompts) * n > MAX_SEQS_PER_REQUEST:
        raise APIError(400, f"{len(prompts)} prompts x n={n} is more than {MAX_SEQS_PER_REQUEST} sequences in one "
                       "request; split the request", "prompt")
    tok = state.tokenizer
    if tok is None and any(isinstance(pr, str) for pr in prompts):
        raise APIError(400, "this model has no tokenizer: pass the prompt as token ids", "prompt")
    items: list[tuple[str | None, list[int]]] = await state.off_loop(_encode_prompts, state, prompts)
    max_tokens = req.max_tokens
    for _, ids in items:
        _resolve_max_tokens(state, len(ids), max_tokens, "max_tokens")
    skip = True if req.skip_special_tokens is None else req.skip_special_tokens
    params = _sampling_params(state, req, max_tokens=max_tokens, logprobs=req.logprobs, skip_special_tokens=skip)
    base = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    gens = [state.engine.generate(f"{base}-{i}", ids, params, prompt=text) for i, (text, ids) in enumerate(items)]
    echo_texts = [(text if text is not None else (tok.decode(ids) if tok is not None else "")) if req.echo else ""
                  for text, ids in items]
    holdback = max((len(s) for s in params.stop), default=1) - 1 if not params.include_stop_str_in_output else 0

    if req.stream:
        return _stream_response(_stream_completions(state, req, params, gens, items, echo_texts, base, created,
                                                    holdback))

    finals = await _collect_finals(raw, gens)
    if finals is None:
        return Response(status_code=499)
    choices = []
    prompt_tokens = completion_tokens = cached = 0
    for i in range(len(items)):
        out = finals[i]
        prompt_tokens += len(out.prompt_token_ids)
        cached += out.num_cached_tokens
        for o in sorted(out.outputs, key=lambda o: o.index):
            completion_tokens += len(o.token_ids)
            vis = _visible_tokens(state, o, params)
            lp = None
            if req.logprobs is not None and o.logprobs is not None:
                lp = _completion_logprobs(state, o.token_ids[:vis], o.logprobs[:vis], len(echo_texts[i]),
                                          req.logprobs, bool(req.return_tokens_as_token_ids))
            choices.append({"index": i * n + o.index, "text": echo_texts[i] + o.text, "logprobs": lp,
                            "finish_reason": _finish(o.finish_reason), "stop_reason": o.stop_reason})
    return {"id": base, "object": "text_completion", "created": created, "model": req.model, "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens, cached)}


def _encode(state: _State, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of text (on a prep thread), cut at max_model_len: a longer prompt is refused anyway, and turning
    millions of ids into a Python list holds the GIL long enough to stall the event loop."""
    if not text:
        return []
    return state.worker_tokenizer.encode(text, add_special_tokens=add_special_tokens, truncation=True,
                                         max_length=state.max_model_len)


def _encode_prompts(state: _State, prompts: list) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) of each prompt, checked (on a prep thread)."""
    items = [(pr, _encode(state, pr, True)) if isinstance(pr, str) else (None, [int(t) for t in pr])
             for pr in prompts]
    for i, (_, ids) in enumerate(items):
        _check_prompt_ids(state, ids, "prompt" if len(prompts) == 1 else f"prompt.{i}")
    return items


def _finish(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


async def _stream_completions(state, req, params, gens, items, echo_texts, base, created, holdback):
    n = params.n
    include_usage, continuous = _usage_modes(req)
    trackers = {(i, j): _Tracker(holdback, None) for i in range(len(items)) for j in range(n)}
    echoed: set[tuple[int, int]] = set()
    last: dict[int, RequestOutput] = {}

    def chunk(choices):
        body = {"id": base, "object": "text_completion", "created": created, "model": req.model, "choices": choices}
        if continuous:
            body["usage"] = _usage_of(last.values())
        return _sse(body)

    try:
        async for i, out in _merge(gens):
            last[i] = out
            choices = []
            for o in out.outputs:
                key = (i, o.index)
                tr = trackers[key]
                final = o.finish_reason is not None
                offset = len(echo_texts[i]) + tr.sent_text
                text = tr.text_delta(o, final)
                if req.echo and key not in echoed:
                    echoed.add(key)
                    text = echo_texts[i] + text
                ids, lps = tr.token_delta(o, _visible_tokens(state, o, params) if final else len(o.token_ids))
                if not text and not final and not ids:
                    continue
                lp = None
                if req.logprobs is not None and lps:
                    lp = _completion_logprobs(state, ids, lps, offset, req.logprobs,
                                              bool(req.return_tokens_as_token_ids))
                choices.append({"index": i * n + o.index, "text": text, "logprobs": lp,
                                "finish_reason": _finish(o.finish_reason) if final else None,
                                "stop_reason": o.stop_reason if final else None})
            if choices:
                yield chunk(choices)
    except (RequestError, EngineDeadError, RequestFailed) as e:
        yield _stream_error_end(e)
        return
    if include_usage:
        yield _sse({"id": base, "object": "text_completion", "created": created, "model": req.model,
                    "choices": [], "usage": _usage_of(last.values())})
    yield SSE_DONE


# ---- /v1/chat/completions --------------------------------------------------------------------------------------
def _chat_logprobs(state: _State, ids: list[int], lps: list, n_top: int, as_ids: bool = False) -> dict[str, Any]:
    content = []
    for tid, lp in zip(ids, lps):
        s = state.token_str(tid, as_ids)
        tops = [{"token": state.token_str(t, as_ids), "logprob": v, "bytes": list(state.token_str(t).encode())}
                for t, v in list(lp.top.items())[:n_top]]
        content.append({"token": s, "logprob": lp.logprob, "bytes": list(s.encode()), "top_logprobs": tops})
    return {"content": content, "refusal": None}


def _tool_call_json(d: chatmod.ToolCallDelta) -> dict[str, Any]:
    if d.id is not None:
        return {"index": d.index, "id": d.id, "type": "function",
                "function": {"name": d.name, "arguments": d.arguments}}
    return {"index": d.index, "function": {"arguments": d.arguments}}


@dataclass
class _PreparedChat:
    rendered: chatmod.RenderedChat
    ids: list[int]
    grammar: str | None          # the compiled constraint, checked up front


def _prepare_chat(state: _State, req: ChatCompletionRequest) -> _PreparedChat:
    """Render, tokenise and compile the constraint of a chat request (on a prep thread)."""
    try:
        rendered = chatmod.render_chat(state.worker_tokenizer, req)
    except chatmod.ChatRequestError as e:
        raise APIError(400, str(e), e.param) from None
    grammar = None
    if rendered.constraint is not None:
        if state.grammar is None:
            raise APIError(400, "this engine cannot constrain outputs", rendered.constraint.param)
        try:
            grammar = state.grammar.check(rendered.constraint.spec)
        except RequestError as e:
            raise APIError(400, f"{rendered.constraint.param}: {e}", rendered.constraint.param) from None
    ids = _encode(state, rendered.prompt, False)
    _check_prompt_ids(state, ids, "messages")
    return _PreparedChat(rendered, ids, grammar)


def _check_strict_tools(req: ChatCompletionRequest) -> None:
    forced = req.tool_choice == "required" or isinstance(req.tool_choice, chatmod.NamedToolChoice)
    for i, t in enumerate(req.tools or []):
        if t.function.strict and not forced:
            raise APIError(400, "strict tools need tool_choice 'required' or a named function (the calls are then "
                           "decoded under the schemas); with 'auto' adherence is not guaranteed",
                           f"tools.{i}.function.strict")


async def _chat(state: _State, req: ChatCompletionRequest, raw: Request):
    _check_model(state, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    _check_strict_tools(req)
    if state.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot serve chat; use /v1/completions with token "
                       "ids", "messages")
    prep = await state.off_loop(_prepare_chat, state, req)
    rendered, ids = prep.rendered, prep.ids
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = _resolve_max_tokens(state, len(ids), max_tokens, param)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling_params(state, req, max_tokens=max_tokens, logprobs=logprobs, skip_special_tokens=False)
    if rendered.reasoning_off:
        params.logit_bias = {**reasoning_ban(state.tokenizer), **params.logit_bias}
    if rendered.constraint is not None:
        params.structured_outputs = rendered.constraint.spec
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    gen = state.engine.generate(rid, ids, params)
    holdback = max((len(s) for s in params.stop), default=1) - 1 if not params.include_stop_str_in_output else 0
    single_call = req.parallel_tool_calls is False
    as_ids = bool(req.return_tokens_as_token_ids)

    def new_parser():
        return chatmod.ChatParser(rendered.tools_enabled, rendered.in_reasoning, tool_names=rendered.tool_names)

    if req.stream:
        return _stream_response(_stream_chat(state, req, params, gen, len(ids), new_parser, rid, created, holdback,
                                             logprobs, single_call, as_ids))

    finals = await _collect_finals(raw, [gen])
    if finals is None:
        return Response(status_code=499)
    final = finals[0]
    choices = []
    completion_tokens = 0
    for o in sorted(final.outputs, key=lambda o: o.index):
        completion_tokens += len(o.token_ids)
        parser = new_parser()
        parser.feed(chatmod.strip_specials(o.text, state.specials))
        parser.finish()
        calls = parser.calls[:1] if single_call else parser.calls
        msg: dict[str, Any] = {"role": "assistant", "content": parser.content if (parser.content or not calls)
                               else None}
        if parser.reasoning:
            msg["reasoning_content"] = parser.reasoning
        if calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        vis = _visible_tokens(state, o, params)
        lp = _chat_logprobs(state, o.token_ids[:vis], o.logprobs[:vis], logprobs, as_ids) \
            if logprobs is not None and o.logprobs is not None else None
        choices.append({"index": o.index, "message": msg, "logprobs": lp,
                        "finish_reason": _chat_finish(o, bool(calls)), "stop_reason": o.stop_reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": req.model, "choices": choices,
            "usage": _usage(len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens)}


def _chat_finish(o: CompletionOutput, called: bool) -> str | None:
    reason = _finish(o.finish_reason)
    return "tool_calls" if called and reason == "stop" else reason


def _usage_of(outs) -> dict[str, Any]:
    """Usage so far of a stream's requests (their newest snapshots)."""
    outs = list(outs)
    return _usage(sum(len(o.prompt_token_ids) for o in outs), sum(len(c.token_ids) for o in outs for c in o.outputs),
                  sum(o.num_cached_tokens for o in outs))


def _usage_modes(req) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage in every chunk) as stream_options asks."""
    so = req.stream_options
    return bool(so and so.include_usage), bool(so and so.continuous_usage_stats)


async def _stream_chat(state, req, params, gen, n_prompt, new_parser, rid, created, holdback, logprobs,
                       single_call, as_ids):
    n = params.n
    include_usage, continuous = _usage_modes(req)
    trackers = [_Tracker(holdback, state.specials) for _ in range(n)]
    parsers = [new_parser() for _ in range(n)]
    done = [False] * n
    last: RequestOutput | None = None

    def chunk(choices):
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "choices": choices}
        if continuous:
            body["usage"] = _usage_of([last]) if last is not None else _usage(n_prompt, 0, 0)
        return _sse(body)

    def delta_json(d: chatmod.ParsedDelta) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if d.reasoning:
            out["reasoning_content"] = d.reasoning
        if d.content:
            out["content"] = d.content
        calls = [c for c in d.tool_calls if not single_call or c.index == 0]
        if calls:
            out["tool_calls"] = [_tool_call_json(c) for c in calls]
        return out

    # the role comes first, before any generation (as OpenAI does)
    yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for j in range(n)])
    try:
        async for _, out in _merge([gen]):
            last = out
            choices = []
            for o in out.outputs:
                j = o.index
                if done[j]:
                    continue
                final = o.finish_reason is not None
                p = parsers[j]
                d = p.feed(trackers[j].text_delta(o, final))
                if final:
                    d.merge(p.finish())
                ids, lps = trackers[j].token_delta(o, _visible_tokens(state, o, params) if final
                                                   else len(o.token_ids))
                lp = _chat_logprobs(state, ids, lps, logprobs, as_ids) if logprobs is not None and lps else None
                dj = delta_json(d)
                if not (dj or lp or final):
                    continue
                # one entry per choice per chunk: the last delta carries the finish reason itself
                entry = {"index": j, "delta": dj, "logprobs": lp, "finish_reason": None}
                if final:
                    done[j] = True
                    entry.update(finish_reason=_chat_finish(o, bool(p.calls)), stop_reason=o.stop_reason)
                choices.append(entry)
            if choices:
                yield chunk(choices)
    except (RequestError, EngineDeadError, RequestFailed) as e:
        yield _stream_error_end(e)
        return
    if include_usage and last is not None:
        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                    "choices": [], "usage": _usage_of([last])})
    yield SSE_DONE
