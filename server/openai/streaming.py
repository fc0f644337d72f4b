"""Answers of the generating routes: JSON, or server-sent events with `stream`.

A stream is `data: {chunk}\\n\\n` lines, then `data: [DONE]\\n\\n`. An engine error after the first byte can no
longer change the status: it is sent as one `data: {"error": ...}` event, and the stream ends there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from server.engine.api import GenerationOutput
from server.openai.choices import Choice, final_status, usage
from server.openai.errors import ERROR_BODY, ErrorResponse, failed
from server.openai.generation import ClientDisconnected, Generation
from server.openai.protocol import Usage, dump
from server.openai.sampling import SamplingFields
from server.openai.served import ServedModels


class Chunks(Protocol):
    """Turns engine outputs into the stream chunks of one endpoint."""

    def for_output(self, index: int, output: GenerationOutput, first: bool) -> list[Any]: ...

    def usage(self, usage: Usage) -> Any: ...


def sse(model: BaseModel) -> str:
    """One server-sent event: the model serialized once, in pydantic's Rust serializer (compact UTF-8 JSON)."""
    return f"data: {model.model_dump_json()}\n\n"


async def stream(
    served: ServedModels, request: SamplingFields, generation: Generation, num_choices: int, chunks: Chunks
) -> AsyncIterator[str]:
    """The events of a streamed generation; with `stream_options.include_usage` a last chunk holds the usage."""
    choices = [Choice() for _ in range(num_choices)]
    status = "aborted"
    try:
        async for index, output in generation.outputs():
            if output.finish_reason == "error":
                status = "error"
                yield sse(ErrorResponse(error=failed(output).info))
                return
            first = not choices[index].started
            choices[index].add(output)
            for chunk in chunks.for_output(index, output, first):
                yield sse(chunk)
        if request.stream_options and request.stream_options.include_usage:
            yield sse(chunks.usage(usage(choices, request.n)))
        yield "data: [DONE]\n\n"
        status = final_status(choices)
    except ClientDisconnected:
        return
    finally:
        generation.close()
        served.count(request.model, status)


async def respond(result: Awaitable[BaseModel | dict[str, Any] | AsyncIterator[str]]) -> Response:
    """A response model (or a JSON-ready dict) as JSON, a stream of events as text/event-stream."""
    answer = await result
    if isinstance(answer, AsyncIterator):
        return StreamingResponse(
            answer,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return JSONResponse(answer if isinstance(answer, dict) else dump(answer))


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (ASGI `http.disconnect`); waits, never polls."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


_SSE_EVENT = {  # one event of a stream (OpenAPI 3.1: the schema of text/event-stream describes each event)
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk as JSON, an error object, or [DONE]"}},
}
GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {  # OpenAPI: what chat and completions answer
    200: {
        "content": {"text/event-stream": {"schema": _SSE_EVENT}},
        "description": "JSON, or SSE with `stream`",
    },
    400: {**ERROR_BODY, "description": "invalid request; `param` names the field"},
    401: {**ERROR_BODY, "description": "missing or wrong API key (--api-key)"},
    404: {**ERROR_BODY, "description": "unknown model"},
    413: {**ERROR_BODY, "description": "body over --max-request-bytes"},
    429: {**ERROR_BODY, "description": "every wait queue is full; retry after `Retry-After` seconds"},
    500: {**ERROR_BODY, "description": "internal error (details in the server log)"},
    503: {**ERROR_BODY, "description": "the model cannot take requests now"},
}
