"""`--api-key` (as vLLM's): every `/v1/*` route, /tokenize and /detokenize need `Authorization: Bearer <key>`;
anything else is a 401 in OpenAI's error shape. `/health`, `/metrics` and the docs stay open, as in vLLM."""

from __future__ import annotations

import hmac

from server.openai.errors import ErrorInfo, error_response

_KEYED = ("/v1", "/tokenize", "/detokenize")  # the routes --api-key guards (vLLM's)


class RequireAPIKey:
    """ASGI middleware: the keyed routes need `Authorization: Bearer <api_key>` (compared in constant time).

    Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would buffer streamed responses through a task.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(_KEYED) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        info = ErrorInfo(
            message="Incorrect or missing API key: send 'Authorization: Bearer <key>' (--api-key)",
            type="invalid_request_error",
            code="invalid_api_key",
        )
        response = error_response(401, info)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)
