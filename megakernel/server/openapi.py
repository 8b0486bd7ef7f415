"""The OpenAPI schema as this server answers: its served model names, the context length, token id ranges and
the Bearer auth."""

from __future__ import annotations

from fastapi import FastAPI

from megakernel.server.state import ServerState


def patch_openapi(app: FastAPI, state: ServerState) -> None:
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
