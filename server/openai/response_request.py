"""The Responses API's request (POST /v1/responses) and how it reads as a chat request (`as_chat`): `instructions`
and the `input` items become chat turns after those of the conversation `previous_response_id` ends; function tools,
tool_choice, `text.format` and max_output_tokens become chat's tools, tool_choice, response_format and
max_completion_tokens; errors name the Responses field. Shared by responses.py; no route of its own.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag

from server.openai import chat_core
from server.openai.errors import OpenAIError
from server.openai.protocol import ChatMessage, StrictRequest
from server.openai.sampling import JSONSchemaFormat, ResponseFormat
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

    def item(self, item_id: str) -> dict[str, Any]:
        """As GET /v1/responses/{id}/input_items lists it."""
        parts = (
            [{"type": "input_text", "text": self.content}] if isinstance(self.content, str) else self.content
        )
        content = [p if isinstance(p, dict) else p.model_dump() for p in parts]
        return {
            "id": item_id,
            "type": "message",
            "role": self.role,
            "content": content,
            "status": "completed",
        }


class FunctionCallInput(StrictRequest):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str

    def item(self, item_id: str) -> dict[str, Any]:
        return {"id": item_id, **self.model_dump(), "status": "completed"}


class FunctionCallOutputInput(StrictRequest):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]

    def turn(self) -> dict[str, Any]:
        text = self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)
        return {"role": "tool", "tool_call_id": self.call_id, "content": text}

    def item(self, item_id: str) -> dict[str, Any]:
        return {"id": item_id, **self.model_dump(), "status": "completed"}


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

    def input_items(self, response_id: str) -> list[dict[str, Any]]:
        """The input as GET /v1/responses/{id}/input_items lists it: items with ids (`<response id>_in<i>`)."""
        given = [MessageInput(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        return [item.item(f"{response_id}_in{i}") for i, item in enumerate(given)]

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
