"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat machinery.

A Responses request is read as a chat request (`as_chat`): `instructions` and the `input` items become chat turns,
after the turns of the conversation `previous_response_id` ends (kept in the response store: response_store.py);
function tools, tool_choice, `text.format` and max_output_tokens become chat's tools, tool_choice, response_format
and max_completion_tokens. So forced tool calls go through the grammar and structured output works as in chat.
The answer's text and tool calls become output items (response_items.py). Errors name the Responses field
(`max_output_tokens`, `text.format.schema`, `input`), not chat's.

A continued conversation renders as the previous prompt, the previous answer and the new turns, so its prompt
extends the previous one's and the prefix cache (and the KV-aware router) reuse its blocks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Discriminator, Field, Tag

from server.openai import chat_core
from server.openai.choices import Choice, collect, final_status, usage
from server.openai.errors import ERROR_BODY, OpenAIError, failed
from server.openai.fields import refused_field
from server.openai.generation import ClientDisconnected
from server.openai.limits import RequestLimits
from server.openai.protocol import ChatMessage, StrictRequest
from server.openai.response_items import ResponseEvents, assistant_turn, finish, items_of
from server.openai.response_store import ResponseStore
from server.openai.sampling import JSONSchemaFormat, ResponseFormat
from server.openai.served import ServedModels
from server.openai.streaming import GENERATE_RESPONSES, client_gone, respond
from server.openai.tools import FunctionDef, NamedFunction, NamedToolChoice, Tool


class TextContent(StrictRequest):
    type: Literal["input_text", "output_text"]  # an assistant turn sent back holds output_text
    text: str


class MessageInput(StrictRequest):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]

    def turn(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class FunctionCallInput(StrictRequest):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputInput(StrictRequest):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]

    def turn(self) -> dict[str, Any]:
        text = self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)
        return {"role": "tool", "tool_call_id": self.call_id, "content": text}


def _item_type(value: Any) -> str:
    """The union member of an input item, by its `type` (a message may leave it out). The tag is bracketed so that
    an error's `param` leaves it out (errors._param_path): `input.0.content`, not `input.0.item[message].content`."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return f"item[{kind}]"


InputItem = Annotated[
    Annotated[MessageInput, Tag("item[message]")]
    | Annotated[FunctionCallInput, Tag("item[function_call]")]
    | Annotated[FunctionCallOutputInput, Tag("item[function_call_output]")],
    Discriminator(_item_type),
]


class FunctionTool(StrictRequest):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls always follow `parameters` here


class FunctionChoice(StrictRequest):
    type: Literal["function"]
    name: str


class TextFormat(StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictRequest):
    format: TextFormat | None = None


class ResponsesRequest(StrictRequest):
    ENDPOINT: ClassVar[str] = "responses"

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    user: str | None = (
        None  # the end user's id (OpenAI's, for abuse monitoring): accepted, it changes nothing
    )

    def turns(self) -> list[dict[str, Any]]:
        """The input as chat turns; consecutive function calls are one assistant turn's tool calls."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        turns: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, FunctionCallInput):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                if turns and turns[-1]["role"] == "assistant" and not turns[-1]["content"]:
                    turns[-1].setdefault("tool_calls", []).append(call)
                else:
                    turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                turns.append(item.turn())
        return turns


class ChatForResponses(chat_core.ChatCompletionRequest):
    """A Responses request read as chat; the errors chat's code raises name the Responses field."""

    PROMPT_FIELD: ClassVar[str] = "input"
    _NAMES: ClassVar[dict[str, str]] = {
        "max_tokens": "max_output_tokens",
        "max_completion_tokens": "max_output_tokens",
        "response_format.json_schema.schema": "text.format.schema",
        "response_format.json_schema": "text.format",
        "response_format": "text.format",
        "messages": "input",
    }

    def param_name(self, field_name: str) -> str:
        return self._NAMES.get(field_name, super().param_name(field_name))


def as_chat(request: ResponsesRequest, history: list[dict[str, Any]]) -> ChatForResponses:
    """The chat request that answers `request`, continuing the conversation `history` (chat turns)."""
    given = request.turns()
    if not given:
        raise OpenAIError(400, "input: holds no item", param="input")
    turns = ([{"role": "system", "content": request.instructions}] if request.instructions else []) + history
    turns += given
    tools = [
        Tool(type="function", function=FunctionDef(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in request.tools or ()
    ]  # fmt: skip
    choice = request.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return ChatForResponses(
        model=request.model,
        messages=[ChatMessage(**turn) for turn in turns],
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=_response_format(request.text),
        stream=request.stream,
        user=request.user,
    )


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    form = text.format if text is not None else None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return ResponseFormat(type="json_object")
    if form.name is None or form.schema_ is None:
        missing = "name" if form.name is None else "schema"
        raise OpenAIError(
            400, f"text.format.{missing}: required with type json_schema", param=f"text.format.{missing}"
        )
    schema = JSONSchemaFormat(
        name=form.name, description=form.description, schema=form.schema_, strict=form.strict
    )
    return ResponseFormat(type="json_schema", json_schema=schema)


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

    @routes.delete("/v1/responses/{response_id}", responses={404: ERROR_BODY})
    async def delete(response_id: str) -> JSONResponse:
        if not await store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    return routes


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
    """Store the response and the conversation it ends (without the instructions: a continuation sends its own)."""
    if body.store:
        turns = history + body.turns() + [assistant_turn(items)]
        await store.put(response["id"], {"response": response, "turns": turns})


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
