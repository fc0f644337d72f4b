"""FastAPI app of the OpenAI-compatible frontend: the route modules' routers, mounted on one app.

Mount with `build_app({"smollm2": engine}, FrontendMetrics.create(registry))` and serve with uvicorn (Triton's
OpenAI frontend listens on 9000). Routes: GET /v1/models, GET /v1/models/{id} (models.py), POST /tokenize,
POST /detokenize (tokenize.py), POST /v1/chat/completions (chat.py), POST /v1/completions (completions.py),
POST /v1/responses, GET and DELETE /v1/responses/{id} (responses.py), POST /v1/embeddings (embeddings.py), GET and PUT
/v1/strata/models/{model}/disagg (disagg.py); and here GET /version (vLLM's shape), GET /health, GET /metrics
(Prometheus text of the metrics' registry), GET /docs. With `api_key` set, auth.py guards the routes vLLM guards.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from server.engine.api import Engine
from server.openai import chat, completions, disagg, embeddings, responses, tokenize
from server.openai import models as model_cards
from server.openai.auth import RequireAPIKey
from server.openai.embedder import Embedder
from server.openai.errors import add_error_handlers
from server.openai.limits import LimitRequestBody, RequestLimits
from server.openai.metrics import FrontendMetrics
from server.openai.observe import BrowserOrigins, CORSSettings, ObserveRequests
from server.openai.response_store import MemoryResponseStore, ResponseStore
from server.openai.served import ServedModels

try:
    _VERSION = importlib.metadata.version("strata")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    _VERSION = "0+unknown"


class VersionResponse(BaseModel):
    version: str


def build_app(
    models: Mapping[str, Engine],
    metrics: FrontendMetrics | None = None,
    api_key: str | None = None,
    limits: RequestLimits | None = None,
    tool_call_parser: str | None = None,
    response_store: ResponseStore | None = None,
    embedders: Mapping[str, Embedder] | None = None,
    access_log: bool = True,
    cors: CORSSettings | None = None,
) -> FastAPI:
    """The frontend for `models` (served name -> engine, a live view); metrics go to `metrics.registry`; `limits`
    bound each request before it is parsed (body bytes) and before it is tokenized (choices, prompts, characters);
    /v1/responses keeps responses in `response_store` (default: this process's memory, an hour, 10000 at most);
    /v1/embeddings serves `embedders` (served name -> embedding model, a live view); `access_log`: a line per
    request (observe.py); `cors`: the browser origins allowed (None: no CORS headers, as without --allowed-origins).
    """
    embedders = embedders if embedders is not None else {}
    served = ServedModels(models, metrics or FrontendMetrics.create())
    limits = limits or RequestLimits()
    chat_routes = chat.router(served, limits, tool_call_parser)  # first: an unknown parser is a ValueError
    app = FastAPI(title="Strata OpenAI-compatible API", **_without_native_telemetry())
    add_error_handlers(app, served.count_invalid)
    app.add_middleware(LimitRequestBody, max_bytes=limits.max_request_bytes)
    if api_key:  # added last, so it runs first: a client without the key gets 401 before its body is read
        app.add_middleware(RequireAPIKey, api_key=api_key)
    if cors is not None:  # outside the key check: a browser's preflight carries no Authorization header
        app.add_middleware(BrowserOrigins, settings=cors)
    app.add_middleware(
        ObserveRequests, access_log_on=access_log
    )  # outermost: every answer gets its id and line
    app.openapi = lambda: _openapi(app, limits)  # type: ignore[method-assign]

    @app.get("/health", responses={503: {"description": "a model cannot take requests"}})
    async def health() -> JSONResponse:
        """200 while every model can take requests; 503 naming the models whose workers are all gone."""
        down = sorted(name for name, engine in models.items() if not engine.healthy)
        if down:
            return JSONResponse({"status": "unavailable", "models": down}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(generate_latest(served.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=_VERSION)

    app.include_router(model_cards.router(served, embedders))
    app.include_router(tokenize.router(served))
    app.include_router(chat_routes)
    app.include_router(completions.router(served, limits))
    store = response_store or MemoryResponseStore(ttl_s=3600.0, max_entries=10000)
    app.include_router(responses.router(served, limits, tool_call_parser, store))
    app.include_router(embeddings.router(served, embedders))
    app.include_router(disagg.router(models))
    return app


def _without_native_telemetry() -> dict[str, Any]:
    """FastAPI's own OpenTelemetry spans off (FastAPI >= 0.16x has them, on the global provider): the request's
    server span is observe.py's, on Strata's provider; PyTriton sets a global one under Triton's OpenTelemetry
    mode, and FastAPI's would add a second server span per request there."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}


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
