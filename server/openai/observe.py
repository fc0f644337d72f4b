"""What the OpenAI port tells an operator about each HTTP request: its id, an access log line, a trace span; and
which browser origins may call it (CORS).

`ObserveRequests` (plain ASGI, outermost) gives every request an id (`X-Request-Id` in the response; the engine
requests of a generation are `{id}-{i}`, so a worker's log lines carry it too), logs one line per request on the
`strata.access` logger (method, path, status, seconds, id, and the client's own X-Request-Id when it sent one),
and while tracing is on (server/tracing.py) runs the request inside a server span that continues the client's
`traceparent`. `server.logs.REQUEST_ID` holds the id for the request's code and for the JSON log lines.

`BrowserOrigins` is Starlette's CORS middleware over every route but the admin ones (`/v1/strata/...`: live
thresholds), which a browser origin reaches only with `admin_routes`.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server import tracing
from server.logs import REQUEST_ID

access_log = logging.getLogger("strata.access")
# a client's X-Request-Id worth logging (no spaces, no controls)
_CLIENT_ID = re.compile(r"[\w.:@/+=-]{1,128}")
ADMIN_PREFIX = "/v1/strata/"


class ObserveRequests:
    """ASGI middleware: request id, access log line and (tracing on) server span of every HTTP request."""

    def __init__(self, app: ASGIApp, access_log_on: bool = True) -> None:
        self.app = app
        self.access_log_on = access_log_on

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, request_id = time.perf_counter(), uuid.uuid4().hex
        status = 500  # what the log says when the app raised before answering

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
            await send(message)

        async def serve() -> None:
            try:
                await self.app(scope, receive, send_with_id)
            finally:  # inside the request's context: a JSON line carries its request and trace ids
                if self.access_log_on:
                    self._log(scope, status, time.perf_counter() - started, request_id)

        token = REQUEST_ID.set(request_id)
        try:
            if tracing.enabled():
                await self._traced(scope, serve, request_id, lambda: status)
            else:
                await serve()
        finally:
            REQUEST_ID.reset(token)

    @staticmethod
    async def _traced(scope: Scope, serve, request_id: str, status) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        span = tracing.tracer().start_span(  # type: ignore[union-attr]
            f"{scope['method']} {scope['path']}",
            tracing.extract(headers),
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": scope["method"],
                "url.path": scope["path"],
                "strata.request_id": request_id,
            },
        )
        try:
            with trace.use_span(span, end_on_exit=False, record_exception=True):
                await serve()
        finally:
            route = scope.get("route")
            if route is not None and hasattr(route, "path"):  # the template: one span name per route
                span.update_name(f"{scope['method']} {route.path}")
                span.set_attribute("http.route", route.path)
            span.set_attribute("http.response.status_code", status())
            if status() >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()

    @staticmethod
    def _log(scope: Scope, status: int, seconds: float, request_id: str) -> None:
        client_id = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"").decode("latin-1")
        extra = f" client_request_id={client_id}" if _CLIENT_ID.fullmatch(client_id) else ""
        access_log.info(
            '%s "%s %s" %d %.3fs request_id=%s%s',
            (scope.get("client") or ("-",))[0],
            scope["method"],
            scope["path"],
            status,
            seconds,
            request_id,
            extra,
        )


@dataclass(frozen=True, slots=True)
class CORSSettings:
    """vLLM's --allowed-origins/--allowed-methods/--allowed-headers/--allow-credentials, and whether the admin
    routes take part (--cors-admin-routes)."""

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    admin_routes: bool = False


class BrowserOrigins:
    """ASGI middleware: CORS (Starlette's) on every route, the admin routes only with `admin_routes`; an admin
    route's preflight from a browser origin is answered 403 without any Access-Control header."""

    def __init__(self, app: ASGIApp, settings: CORSSettings) -> None:
        self.app = app
        self.settings = settings
        self.cors = CORSMiddleware(
            app,
            allow_origins=list(settings.allowed_origins),
            allow_methods=list(settings.allowed_methods),
            allow_headers=list(settings.allowed_headers),
            allow_credentials=settings.allow_credentials,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or self.settings.admin_routes
            or not scope["path"].startswith(ADMIN_PREFIX)
        ):
            await self.cors(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and any(
            k == b"access-control-request-method" for k, _ in scope["headers"]
        ):
            await send({"type": "http.response.start", "status": 403, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, receive, send)
