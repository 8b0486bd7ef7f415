"""Server-sent events framing of streamed responses: one `data: <json>` event per chunk, `data: [DONE]` last."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from megakernel.server.errors import engine_error, error_body

SSE_DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def stream_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def stream_error_end(e: BaseException) -> str:
    """How a stream that failed after its headers were sent ends: an error event, then [DONE]."""
    err = engine_error(e)
    return sse(error_body(err.status, err.message, err.param, err.code, err.type)) + SSE_DONE
