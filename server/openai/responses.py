"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items: OpenAI's Responses API over the chat machinery.

A Responses request is read as a chat request (response_request.py's `as_chat`), after the turns of the
conversation `previous_response_id` ends (kept in the response store: response_store.py), so forced tool calls go
through the grammar and structured output works as in chat.
The answer's text and tool calls become output items (response_items.py). Errors name the Responses field
(`max_output_tokens`, `text.format.schema`, `input`), not chat's.

A continued conversation renders as the previous prompt, the previous answer and the new turns, so its prompt
extends the previous one's and the prefix cache (and the KV-aware router) reuse its blocks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from server.openai import chat_core
from server.openai.choices import Choice, collect, final_status, usage
from server.openai.errors import ERROR_BODY, OpenAIError, failed
from server.openai.fields import refused_field
from server.openai.generation import ClientDisconnected
from server.openai.limits import RequestLimits
from server.openai.response_items import ResponseEvents, assistant_turn, finish, items_of
from server.openai.response_request import ResponsesRequest, as_chat
from server.openai.response_store import ResponseStore
from server.openai.served import ServedModels
from server.openai.streaming import GENERATE_RESPONSES, client_gone, respond


def router(
    served: ServedModels, limits: RequestLimits, tool_call_parser: str | None, store: ResponseStore
) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/responses", responses=GENERATE_RESPONSES)
    async def create(body: ResponsesRequest, request: Request) -> Response:
        return await respond(_answer(served, limits, tool_call_parser, store, body, request))

    @routes.get("/v1/responses/{response_id}", responses={404: ERROR_BODY})
    async def retrieve(response_id: str) -> JSONResponse:
        stored = await store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return JSONResponse(stored["response"])

    @routes.get("/v1/responses/{response_id}/input_items", responses={404: ERROR_BODY})
    async def input_items(
        response_id: str,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> JSONResponse:
        """The stored response's input items, a page of `limit` from the item after `after` in `order` (OpenAI's
        list shape; the newest first by default)."""
        stored = await store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return JSONResponse(_page(stored.get("input_items", []), limit, order, after))

    @routes.delete("/v1/responses/{response_id}", responses={404: ERROR_BODY})
    async def delete(response_id: str) -> JSONResponse:
        if not await store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    return routes


def _page(items: list[dict[str, Any]], limit: int, order: str, after: str | None) -> dict[str, Any]:
    ordered = items[::-1] if order == "desc" else items
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise OpenAIError(400, f"after: no input item with id '{after}' in this response", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    data = ordered[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ordered) > limit,
    }


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"No response with id '{response_id}' is stored", type_="not_found_error")


async def _answer(
    served: ServedModels,
    limits: RequestLimits,
    tool_call_parser: str | None,
    store: ResponseStore,
    body: ResponsesRequest,
    request: Request,
) -> dict[str, Any] | AsyncIterator[str]:
    refused = refused_field(body.model_extra, body.ENDPOINT)
    if refused is not None:
        served.refuse(body.model, refused[1], refused[0])
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = await store.get(body.previous_response_id)
        if previous is None:
            served.refuse(
                body.model,
                f"previous_response_id: no response with id '{body.previous_response_id}' is stored",
                "previous_response_id",
            )
        history = previous["turns"]
    try:
        chat = as_chat(body, history)
    except OpenAIError as exc:  # counted as a refused request
        served.refuse(body.model, exc.info.message, exc.info.param)
    served.check_limits(chat, limits)
    started = await chat_core.start(served, tool_call_parser, chat, lambda: client_gone(request))
    response = _response(body, started.generation.request_id)
    if body.stream:
        return _stream(served, store, body, started, response, history)
    choices = await collect(served, chat, started.generation, 1)
    answer = started.response(choices)
    items = items_of(answer.choices[0])
    finish(response, items, answer.choices[0].finish_reason, answer.usage)
    await _keep(store, body, response, history, items)
    return response


def _response(body: ResponsesRequest, request_id: str) -> dict[str, Any]:
    """The response object before its outcome (response_items.finish adds it)."""
    return {
        "id": f"resp_{request_id}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": body.model,
        "output": [],
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in body.tools or ()],
        "tool_choice": _dump(body.tool_choice) if body.tool_choice is not None else "auto",
        "parallel_tool_calls": body.parallel_tool_calls,
        "text": {"format": _dump(body.text.format) if body.text and body.text.format else {"type": "text"}},
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "metadata": body.metadata or {},
        "truncation": "disabled",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "usage": None,
        "user": body.user,
    }


def _dump(value: Any) -> Any:
    return (
        value.model_dump(mode="json", by_alias=True, exclude_none=True)
        if hasattr(value, "model_dump")
        else value
    )


async def _keep(
    store: ResponseStore,
    body: ResponsesRequest,
    response: dict[str, Any],
    history: list[dict[str, Any]],
    items: list[dict[str, Any]],
) -> None:
    """Store the response, the conversation it ends (without the instructions: a continuation sends its own) and
    its input items."""
    if body.store:
        turns = history + body.turns() + [assistant_turn(items)]
        stored = {"response": response, "turns": turns, "input_items": body.input_items(response["id"])}
        await store.put(response["id"], stored)


async def _stream(
    served: ServedModels,
    store: ResponseStore,
    body: ResponsesRequest,
    started: chat_core.ChatGeneration,
    response: dict[str, Any],
    history: list[dict[str, Any]],
) -> AsyncIterator[str]:
    events = ResponseEvents(response)
    chunks = started.chunks()
    choice = Choice()
    status = "aborted"
    try:
        for event in events.start():
            yield event
        async for _, output in started.generation.outputs():
            if output.finish_reason == "error":
                status = "error"
                error = failed(output).info
                yield events.event("error", code=error.code, message=error.message, param=error.param)
                return
            first = not choice.started
            choice.add(output)
            for chunk in chunks.for_output(0, output, first):
                for part in chunk.choices:
                    for event in events.delta(part.delta):
                        yield event
        closing = events.end(choice.finish_reason, usage([choice], 1))
        await _keep(store, body, response, history, events.items)
        for event in closing:
            yield event
        status = final_status([choice])
    except ClientDisconnected:
        return
    finally:
        started.generation.close()
        served.count(body.model, status)
