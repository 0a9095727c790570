"""The FastAPI application: routes, the API key, OpenAI error bodies (400 for every malformed request,
naming the field), /health and /metrics."""
from __future__ import annotations

import hmac
import json
import re
import time

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer.entrypoints.openai import serving_recipe
from deepinfer.entrypoints.openai.protocol import APIError, ChatRequest, CompletionRequest, error_body
from deepinfer.entrypoints.openai.serving import ClientDisconnected, ServerState
from deepinfer.entrypoints.openai.serving_completions import create_completion

CLIENT_CLOSED = 499  # nginx's status for a request whose client went away (never seen by that client)


_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")  # pydantic's tag of a union's member


def _param(loc: tuple) -> str:
    """The request field a validation error is about ("response_format.json_schema", "messages.0")."""
    parts = [str(p) for p in loc if p != "body" and not _UNION_MEMBER.match(str(p))]
    return ".".join(parts) if parts else "body"


def _body_schema(properties: dict, required: list[str]) -> dict:
    """OpenAPI request body of an endpoint whose body deepseek-recipe validates (the main fields only)."""
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": True}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def build_app(state: ServerState, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="deepinfer", version="1", summary="OpenAI-compatible server for DeepSeek V4 / V4.1")
    app.state.server = state

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", None, "invalid_api_key")

    guarded = [Depends(check_key)]

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {"loc": ("body",), "msg": "invalid request"}
        param = _param(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            msg, param = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", "body"
        elif first.get("type") == "extra_forbidden":  # understood or refused, never ignored
            msg = f"{param}: not supported by this server (an unknown field, or one it does not implement)"
        else:
            msg = f"{param}: {first['msg']}"
        return JSONResponse(error_body(400, msg, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def _gone(_, e):
        return Response(status_code=CLIENT_CLOSED)

    @app.get("/health")
    async def health():
        if state.client.dead:
            return JSONResponse(error_body(503, f"engine unavailable: {state.client.dead}"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        state.metrics.in_flight.set(state.in_flight)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(state.started),
                                            "owned_by": "deepinfer", "root": state.model_dir,
                                            "max_model_len": state.max_model_len}
                                           for name in [state.model_name]]}

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(req: CompletionRequest, raw: Request):
        return await create_completion(req, raw, state)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat(req: ChatRequest, raw: Request):
        return await serving_recipe.create_chat(req, raw, state)

    async def _json_body(raw: Request) -> dict:
        try:
            body = json.loads(await raw.body())
        except ValueError as e:
            raise APIError(400, f"the body is not valid JSON: {e}", "body") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", "body")
        return body

    @app.post("/v1/messages", dependencies=guarded, openapi_extra=_body_schema(
        {"model": {"type": "string"}, "max_tokens": {"type": "integer"}, "stream": {"type": "boolean"},
         "messages": {"type": "array", "items": {"type": "object"}}}, ["model", "max_tokens", "messages"]))
    async def messages(raw: Request):
        """Anthropic Messages (deepseek-recipe converts the request and emits its events)."""
        return await serving_recipe.create(serving_recipe.MESSAGES, await _json_body(raw), raw, state)

    @app.post("/v1/responses", dependencies=guarded, openapi_extra=_body_schema(
        {"model": {"type": "string"}, "max_output_tokens": {"type": "integer"}, "stream": {"type": "boolean"},
         "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}}, ["model", "input"]))
    async def responses(raw: Request):
        """OpenAI Responses (deepseek-recipe converts the request and emits its events)."""
        return await serving_recipe.create(serving_recipe.RESPONSES, await _json_body(raw), raw, state)

    state.started = time.time()
    return app
