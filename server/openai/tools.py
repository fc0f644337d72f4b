"""Tool calling on the OpenAI chat API: the tools in the prompt, forced calls through the grammar, and the parsers
of free answers (vLLM's `--tool-call-parser` names).

The tools reach the model through its chat template, or the default tool prompt where the template has no tool
support (server/engine/chat.py: the engine renders, since only it knows the template).

tool_choice:
    none        no call is parsed; the answer is text
    auto        free generation; the parser (`--tool-call-parser`, with `--enable-auto-tool-choice`) finds calls
    required    the grammar forces a JSON array of one or more {"name", "arguments"} objects, each `arguments`
                valid against its function's `parameters` (one call with parallel_tool_calls false)
    {named}     the grammar forces that function's `arguments` object (finish_reason "stop", as OpenAI's)
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from server.engine.api import RequestError, StructuredOutput, structured_spec
from server.openai.protocol import StrictRequest


class FunctionDef(StrictRequest):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # forced calls always follow `parameters` here


class Tool(StrictRequest):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: NamedFunction


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first of a call has its id, type and name; later ones append to its
    arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ToolRequest(Protocol):
    """The fields of a chat request that tool calling reads."""

    tools: list[Tool] | None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None
    parallel_tool_calls: bool | None


@dataclass(slots=True)
class Call:
    name: str
    arguments: str  # JSON text of the arguments object


def choice_of(request: ToolRequest, auto_parser: str | None) -> str | None:
    """The request's effective tool_choice: None without tools (or "none"), else "auto", "required" or the named
    function; RequestError naming tool_choice for one this server cannot do."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice", "needs `tools`")
        return None
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if auto_parser is None:
            raise RequestError(
                "tool_choice",
                '"auto" needs the server started with --enable-auto-tool-choice --tool-call-parser '
                '(or send "required", a named function, or "none")',
            )
        return "auto"
    if choice == "required":
        return "required"
    names = [t.function.name for t in request.tools]
    if choice.function.name not in names:
        raise RequestError("tool_choice", f"names {choice.function.name!r}, which is not among the tools")
    return choice.function.name


def grammar(request: ToolRequest, choice: str | None) -> StructuredOutput | None:
    """The grammar that forces `choice` ("required" or a function's name); None for "auto" and no tools."""
    if choice in (None, "auto"):
        return None
    tools = {t.function.name: t.function for t in request.tools or ()}
    if choice != "required":
        return structured_spec("tools", "json", _parameters(tools[choice]))
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": _parameters(function)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, function in tools.items()
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return structured_spec("tools", "json", schema)


def _parameters(function: FunctionDef) -> dict[str, Any]:
    return function.parameters or {"type": "object", "properties": {}}


def forced_calls(text: str, choice: str) -> list[Call]:
    """The calls of a grammar-forced answer (`choice` "required" or the named function)."""
    if choice != "required":
        return [Call(choice, text)]
    return [Call(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)]


class ToolParser(Protocol):
    """Finds the calls in a free answer (tool_choice auto): (the text outside them or None, the calls)."""

    def parse(self, text: str) -> tuple[str | None, list[Call]]: ...


class HermesParser:
    """vLLM's `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; a block that is not
    such JSON stays in the text."""

    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        calls: list[Call] = []
        kept: list[str] = []
        last = 0
        for match in self._BLOCK.finditer(text):
            try:
                call = json.loads(match.group(1))
                calls.append(Call(str(call["name"]), json.dumps(call.get("arguments", {}))))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
            kept.append(text[last : match.start()])
            last = match.end()
        if not calls:
            return text, []
        content = ("".join(kept) + text[last:]).strip()
        return content or None, calls


PARSERS: dict[str, type] = {"hermes": HermesParser}  # --tool-call-parser names


def tool_calls(calls: list[Call]) -> list[ToolCallOut]:
    return [
        ToolCallOut(
            id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCallOut(name=c.name, arguments=c.arguments)
        )
        for c in calls
    ]


class StreamedCalls:
    """One streamed choice's tool calls: what of each output's text is content, and the tool call deltas.

    auto: text streams as content until `<tool_call>` (text that may begin that tag is held back); the rest is
    held and parsed at the end. required: everything is held, the calls sent at the end. A named function: its
    arguments stream as they come, after one delta naming the call."""

    _TAG = "<tool_call>"

    def __init__(self, choice: str, parser: ToolParser | None) -> None:
        self.choice = choice
        self.parser = parser
        self.held = ""
        self.in_calls = choice == "required"
        self.calls: list[Call] = []  # once finished
        self._started = False
        self._id = f"call_{uuid.uuid4().hex[:24]}"

    @property
    def made_calls(self) -> bool:
        return bool(self.calls) or (self._started and self.choice not in ("auto", "required"))

    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        """(content to send now, tool call deltas to send now) for the next piece of the answer."""
        if self.choice not in ("auto", "required"):  # a named function: the text is its arguments
            deltas = []
            self.held += text
            if not self._started:
                self._started = True
                header = DeltaFunctionCall(name=self.choice, arguments="")
                deltas.append(DeltaToolCall(index=0, id=self._id, type="function", function=header))
            if text:
                deltas.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text)))
            if finished:
                self.calls = [Call(self.choice, self.held)]
            return "", deltas
        content = ""
        self.held += text
        if not self.in_calls:
            start = self.held.find(self._TAG)
            if start >= 0:
                content, self.held, self.in_calls = self.held[:start], self.held[start:], True
            else:
                keep = next(
                    (k for k in range(len(self._TAG) - 1, 0, -1) if self.held.endswith(self._TAG[:k])), 0
                )
                cut = len(self.held) - keep if not finished else len(self.held)
                content, self.held = self.held[:cut], self.held[cut:]
        if not finished or not self.in_calls:
            return content, []
        held, self.held = self.held, ""
        try:
            if self.choice == "required":
                rest, calls = None, forced_calls(held, "required")
            else:
                assert self.parser is not None
                rest, calls = self.parser.parse(held)
        except (json.JSONDecodeError, KeyError, TypeError):
            return content + held, []  # cut short (length): what there is, as text
        self.calls = calls
        deltas = []
        for index, (call, out) in enumerate(zip(calls, tool_calls(calls), strict=True)):
            header = DeltaFunctionCall(name=call.name, arguments="")
            deltas.append(DeltaToolCall(index=index, id=out.id, type="function", function=header))
            deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments)))
        return content + (rest or ""), deltas
