"""OpenAI-compatible HTTP server for megakernel (`megakernel serve`).

Needs the `server` extra (fastapi, uvicorn, pydantic, prometheus-client, llguidance for structured outputs;
cohere-melody for North tool-call parsing). Nothing here is imported by `megakernel` itself, so the engine runs
without these packages.
"""

__all__ = ["create_app", "AsyncEngine", "build_server"]


def __getattr__(name):
    if name == "create_app":
        from megakernel.server.app import create_app

        return create_app
    if name == "AsyncEngine":
        from megakernel.server.async_engine import AsyncEngine

        return AsyncEngine
    if name == "build_server":
        from megakernel.server.cli import build_server

        return build_server
    raise AttributeError(name)
