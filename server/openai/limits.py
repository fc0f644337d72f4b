"""Bounds on one OpenAI request, checked before its text is tokenized or any engine work starts.

`LimitRequestBody` answers a body over `max_request_bytes` with 413 before the app reads it into JSON;
`check_request` refuses too many choices or prompts, and prompts longer (in characters) than the model's context
could hold, with a 400 naming the field. The `strata serve` flags set `RequestLimits`.
"""

from __future__ import annotations

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.engine.api import Engine, RequestError, check_prompt_chars
from server.errors import PositiveInt, field_problem
from server.openai.errors import ErrorInfo, OpenAIError, error_response
from server.openai.sampling import SamplingFields

FLAGS = {  # RequestLimits field -> the `strata serve` flag that sets it
    "max_request_bytes": "--max-request-bytes",
    "max_n": "--max-n",
    "max_prompts": "--max-prompts-per-request",
    "max_seqs": "--max-seqs-per-request",
}


class RequestLimits(msgspec.Struct, frozen=True):
    """Per-request bounds of the OpenAI frontend (each a `strata serve` flag, see FLAGS); `checked` builds one
    from the flags' values."""

    max_request_bytes: PositiveInt = 16 * 1024 * 1024  # HTTP body, bytes
    max_n: PositiveInt = 128  # choices per prompt (OpenAI's own limit)
    max_prompts: PositiveInt = 256  # prompts in one /v1/completions request
    max_seqs: PositiveInt = 256  # n x prompts: engine sequences one request starts

    @classmethod
    def checked(cls, **limits: int) -> RequestLimits:
        """The limits of these field values; ValueError naming the flag of one that is not a positive integer."""
        try:
            return msgspec.convert(limits, cls)
        except msgspec.ValidationError as exc:
            field, problem = field_problem(exc, cls, limits)
            raise ValueError(f"{FLAGS.get(field, field)}: {problem}") from None


def check_request(request: SamplingFields, limits: RequestLimits, engine: Engine | None) -> None:
    """Raise OpenAIError(400) naming the field for a request over `limits`, or (given its `engine`) with a prompt
    of more characters than the model's context could take. Cheap: nothing is tokenized."""
    texts = request.prompt_chars()
    num_prompts = request.num_prompts()
    if request.n > limits.max_n:
        _refuse("n", f"must be at most {limits.max_n} (--max-n), got {request.n}")
    if num_prompts > limits.max_prompts:
        _refuse(
            "prompt",
            f"at most {limits.max_prompts} prompts per request (--max-prompts-per-request), got {num_prompts}",
        )
    if request.n * num_prompts > limits.max_seqs:
        _refuse(
            "n",
            f"n x prompts must be at most {limits.max_seqs} sequences per request (--max-seqs-per-request), "
            f"got {request.n} x {num_prompts}",
        )
    field = request.PROMPT_FIELD
    for num_chars in texts if engine is not None else ():
        try:
            check_prompt_chars(field, num_chars, engine.max_model_len)
        except RequestError as exc:
            _refuse(field, exc.message)


def _refuse(param: str, message: str) -> None:
    raise OpenAIError(400, f"{param}: {message}", param=param)


class LimitRequestBody:
    """ASGI middleware: a request body over `max_bytes` gets 413 in OpenAI's error shape, unread.

    A declared Content-Length is judged at once; a chunked body is read up to the limit, then handed on whole.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
        if declared.isdigit():  # the HTTP server holds the body to this length
            if int(declared) > self.max_bytes:
                await self._too_large(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        body, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body ended: nobody to answer
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            body.append(message)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(body, receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        info = ErrorInfo(
            message=f"the request body is larger than {self.max_bytes} bytes (--max-request-bytes)",
            type="invalid_request_error",
            code="request_too_large",
        )
        response = error_response(413, info)
        response.headers["Connection"] = "close"  # the body is left unread
        await response(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that yields `messages` first, then the client's own (its disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
