"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, from request validation, the
request checks and the engine."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from megakernel.errors import RequestError
from megakernel.server.async_engine import EngineDeadError, RequestFailed

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
                404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                422: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error the client sees as this HTTP status and OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, type), status_code=status, headers=headers)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One message and the offending parameter for pydantic's validation errors of a request body."""
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


def engine_error(e: BaseException) -> APIError:
    """The API error of an engine-side failure of a request."""
    if isinstance(e, RequestError):
        return APIError(400, str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), type="server_error")
    if isinstance(e, RequestFailed):
        return APIError(e.status, str(e), type="server_error")
    return APIError(500, f"{type(e).__name__}: {e}", type="server_error")
