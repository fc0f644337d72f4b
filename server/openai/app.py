"""FastAPI app of the OpenAI-compatible frontend: thin routes over `OpenAIServing`.

Mount with `build_app({"smollm2": engine}, FrontendMetrics.create(registry))` and serve with uvicorn (Triton's
OpenAI frontend listens on 9000). Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
GET /v1/models/{id}, POST /tokenize, POST /detokenize, GET /version (vLLM's shapes), GET /health, GET /metrics
(Prometheus text of the metrics' registry), GET /docs; and Strata's own GET and PUT
/v1/strata/models/{model}/disagg: the thresholds of conditional disaggregation, which an operator or an SLA
planner may change while serving (404 for a model not served disaggregated).

With `api_key` set (`--api-key`, as vLLM), every `/v1/*` route, /tokenize and /detokenize need
`Authorization: Bearer <key>`; anything else is
a 401 in OpenAI's error shape. `/health`, `/metrics` and the docs stay open, as in vLLM.
"""

from __future__ import annotations

import hmac
import importlib.metadata
import logging
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from server.controls import DisaggControl
from server.engine.api import Engine
from server.openai import protocol as p
from server.openai.generation import ClientDisconnected
from server.openai.limits import LimitRequestBody, RequestLimits, check_request
from server.openai.metrics import FrontendMetrics
from server.openai.serving import OpenAIError, OpenAIServing, internal_error

logger = logging.getLogger(__name__)

try:
    _VERSION = importlib.metadata.version("strata")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    _VERSION = "0+unknown"


def build_app(
    models: Mapping[str, Engine],
    metrics: FrontendMetrics | None = None,
    api_key: str | None = None,
    limits: RequestLimits | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The frontend for `models` (served name -> engine); metrics go to `metrics.registry`; `limits` bound each
    request before it is parsed (body bytes) and before it is tokenized (choices, prompts, characters)."""
    metrics = metrics or FrontendMetrics.create()
    limits = limits or RequestLimits()
    serving = OpenAIServing(models, metrics, tool_call_parser)
    app = FastAPI(title="Strata OpenAI-compatible API")
    _add_error_handlers(app, serving)
    app.add_middleware(LimitRequestBody, max_bytes=limits.max_request_bytes)
    if api_key:  # added last, so it runs first: a client without the key gets 401 before its body is read
        app.add_middleware(RequireAPIKey, api_key=api_key)
    app.openapi = lambda: _openapi(app, limits)  # type: ignore[method-assign]

    def check(body: p.SamplingFields) -> None:
        try:
            check_request(body, limits, models.get(body.model))
        except OpenAIError:
            serving.count_invalid(body.model)
            raise

    @app.get("/health", responses={503: {"description": "a model cannot take requests"}})
    async def health() -> JSONResponse:
        """200 while every model can take requests; 503 naming the models whose workers are all gone."""
        down = sorted(name for name, engine in models.items() if not engine.healthy)
        if down:
            return JSONResponse({"status": "unavailable", "models": down}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=p.ModelList)
    async def list_models() -> p.ModelList:
        return serving.list_models()

    @app.get("/v1/models/{model:path}", response_model=p.ModelCard, responses={404: _ERROR})
    async def model_card(model: str) -> p.ModelCard:
        return serving.model_card(model)

    @app.post("/tokenize", response_model=p.TokenizeResponse, responses={400: _ERROR, 404: _ERROR})
    async def tokenize(body: p.TokenizeChat | p.TokenizeCompletion) -> p.TokenizeResponse:
        return await serving.tokenize(body)

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses={400: _ERROR, 404: _ERROR})
    async def detokenize(body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        return await serving.detokenize(body)

    @app.get("/version", response_model=p.VersionResponse)
    async def version() -> p.VersionResponse:
        return p.VersionResponse(version=_VERSION)

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=_GENERATE_RESPONSES)
    async def chat(body: p.ChatCompletionRequest, request: Request) -> Response:
        check(body)
        return await _respond(serving.chat(body, lambda: _client_gone(request)))

    @app.post("/v1/completions", response_model=p.CompletionResponse, responses=_GENERATE_RESPONSES)
    async def completion(body: p.CompletionRequest, request: Request) -> Response:
        check(body)
        return await _respond(serving.completion(body, lambda: _client_gone(request)))

    def disagg_of(model: str) -> DisaggControl:
        control = getattr(models.get(model), "disagg", None)
        if control is None:
            code = "model_not_found" if model not in models else "not_disaggregated"
            raise OpenAIError(
                404, f"The model `{model}` is not served disaggregated", param="model", code=code
            )
        return control

    @app.get(
        "/v1/strata/models/{model}/disagg", response_model=p.DisaggThresholds, responses=_ADMIN_RESPONSES
    )
    async def get_disagg(model: str) -> p.DisaggThresholds:
        return p.DisaggThresholds(**disagg_of(model).thresholds())

    @app.put(
        "/v1/strata/models/{model}/disagg", response_model=p.DisaggThresholds, responses=_ADMIN_RESPONSES
    )
    async def set_disagg(model: str, body: p.DisaggThresholds) -> p.DisaggThresholds:
        control = disagg_of(model)
        control.set(body.max_local_prefill_length, body.max_prefill_queue_size)
        logger.info("%s: disaggregation thresholds now %s", model, control.thresholds())
        return p.DisaggThresholds(**control.thresholds())

    return app


_ERROR = {"model": p.ErrorResponse}
_SSE_EVENT = {  # one event of a stream (OpenAPI 3.1: the schema of text/event-stream describes each event)
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk as JSON, an error object, or [DONE]"}},
}
_GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {"schema": _SSE_EVENT}},
        "description": "JSON, or SSE with `stream`",
    },
    400: {**_ERROR, "description": "invalid request; `param` names the field"},
    401: {**_ERROR, "description": "missing or wrong API key (--api-key)"},
    404: {**_ERROR, "description": "unknown model"},
    413: {**_ERROR, "description": "body over --max-request-bytes"},
    429: {**_ERROR, "description": "every wait queue is full; retry after `Retry-After` seconds"},
    500: {**_ERROR, "description": "internal error (details in the server log)"},
    503: {**_ERROR, "description": "the model cannot take requests now"},
}


_ADMIN_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {**_ERROR, "description": "invalid thresholds; `param` names the field"},
    401: {**_ERROR, "description": "missing or wrong API key (--api-key)"},
    404: {**_ERROR, "description": "unknown model, or not served disaggregated"},
}


def _openapi(app: FastAPI, limits: RequestLimits) -> dict[str, Any]:
    """FastAPI's schema, told what this app really answers: errors are 400 in OpenAI's shape, not FastAPI's 422,
    and `n` is bounded by --max-n."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operation in (op for path in schema["paths"].values() for op in path.values()):
            operation["responses"].pop("422", None)
        components = schema["components"]["schemas"]
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            components[name]["properties"]["n"]["maximum"] = limits.max_n
        app.openapi_schema = schema
    return app.openapi_schema


_KEYED = ("/v1", "/tokenize", "/detokenize")  # the routes --api-key guards (vLLM's)


class RequireAPIKey:
    """ASGI middleware: `/v1/*` needs `Authorization: Bearer <api_key>` (compared in constant time).

    Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would buffer streamed responses through a task.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(_KEYED) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        info = p.ErrorInfo(
            message="Incorrect or missing API key: send 'Authorization: Bearer <key>' (--api-key)",
            type="invalid_request_error",
            code="invalid_api_key",
        )
        response = _error(401, info)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)


async def _respond(result: Awaitable[Any]) -> Response:
    answer = await result
    if isinstance(answer, AsyncIterator):
        return StreamingResponse(
            answer,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return JSONResponse(p.dump(answer))


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (ASGI `http.disconnect`); waits, never polls."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error(status: int, info: p.ErrorInfo, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(p.dump(p.ErrorResponse(error=info)), status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI, serving: OpenAIServing) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error(exc.status, exc.info, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # the deepest error: of a union (content: str | list[TextPart]) the member that got furthest
        first = max(
            exc.errors(), key=lambda e: len(e.get("loc", ())), default={"loc": (), "msg": "invalid request"}
        )
        param = None if first.get("type") == "json_invalid" else _param_path(first.get("loc", ()))
        body = await _json_or_none(request)
        serving.count_invalid(str(body.get("model", "")) if isinstance(body, dict) else "")
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        return _error(400, p.ErrorInfo(message=message, type="invalid_request_error", param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, p.ErrorInfo(message=str(exc.detail), type=kind), exc.headers)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error", exc_info=exc)
        return _error(500, internal_error().info)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "union"}


def _param_path(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """`("body", "messages", 0, "role")` -> "messages.0.role"; pydantic's union-member tags are dropped."""
    parts = [
        str(part) for part in loc[1:] if not (isinstance(part, str) and (part in _TYPE_TAGS or "[" in part))
    ]
    return ".".join(parts) or None


async def _json_or_none(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        return None
