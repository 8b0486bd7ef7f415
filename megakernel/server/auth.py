"""Bearer-token auth of the /v1 routes (`--api-key`); a server without a key lets every request in."""

from __future__ import annotations

import secrets

from fastapi import Request

from megakernel.server.errors import APIError


async def require_api_key(raw: Request) -> None:
    """FastAPI dependency: a 401 unless the request carries `Authorization: Bearer <the server's key>`."""
    key = raw.app.state.mk.cfg.api_key
    if not key:
        return
    header = raw.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect API key provided." if header else
                       "You didn't provide an API key. Pass it as 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")
