"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

A client's mistake is a 400 (or 404 for an unknown model) naming the field in `param`; a full wait queue is a 429
with Retry-After; an engine that cannot take requests is a 503; an engine failure of one request is a 500 with the
engine's reason (exception type and message; tracebacks stay in the server log). Pydantic's and Starlette's own
errors are answered in the same shape (400 rather than FastAPI's 422).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from server.engine.api import EngineOverloaded, EngineUnavailable, GenerationOutput
from server.openai.generation import ClientDisconnected
from server.openai.protocol import dump

logger = logging.getLogger(__name__)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


ERROR_BODY = {"model": ErrorResponse}  # OpenAPI: a response in the error shape (a route's `responses`)


class OpenAIError(Exception):
    """An error the API returns as `{"error": {...}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type_, param=param, code=code)
        self.headers = headers


def internal_error(reason: str | None = None) -> OpenAIError:
    """500; `reason` is an engine's own account of a failed request (GenerationOutput.error)."""
    return OpenAIError(500, reason or "internal server error; see the server log", "internal_server_error")


def unknown_model(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist", param="model", code="model_not_found")


def unavailable(model: str, exc: EngineUnavailable) -> OpenAIError:
    """503: the model's engine cannot take requests now (its workers are gone)."""
    return _service_unavailable(f"model `{model}` cannot take requests now: {exc}")


def failed(output: GenerationOutput) -> OpenAIError:
    """A request that ended with an error: 503 when it was retryable (its worker or ranks failed and no other
    could resume it: the client may retry), else 500 with the engine's account."""
    if output.retryable:
        return _service_unavailable(f"the request could not be finished now ({output.error}); retry")
    return internal_error(output.error)


def _service_unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, type_="service_unavailable", code="engine_unavailable")


def overloaded(model: str, exc: EngineOverloaded) -> OpenAIError:
    """429 with Retry-After (whole seconds, at least 1): the engine's wait queue is full."""
    return OpenAIError(
        429,
        f"model `{model}` is overloaded: {exc}",
        type_="rate_limit_exceeded",
        code="queue_full",
        headers={"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))},
    )


def error_response(status: int, info: ErrorInfo, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(dump(ErrorResponse(error=info)), status_code=status, headers=headers)


def add_error_handlers(app: FastAPI, count_invalid: Callable[[str], None]) -> None:
    """Answer every error of `app` in OpenAI's shape; `count_invalid(model)` counts a body that failed validation."""

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.info, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # the deepest error: of a union (content: str | list[TextPart]) the member that got furthest
        first = max(
            exc.errors(), key=lambda e: len(e.get("loc", ())), default={"loc": (), "msg": "invalid request"}
        )
        param = None if first.get("type") == "json_invalid" else _param_path(first.get("loc", ()))
        body = await _json_or_none(request)
        count_invalid(str(body.get("model", "")) if isinstance(body, dict) else "")
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        return error_response(400, ErrorInfo(message=message, type="invalid_request_error", param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, ErrorInfo(message=str(exc.detail), type=kind), exc.headers)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error", exc_info=exc)
        return error_response(500, internal_error().info)


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
