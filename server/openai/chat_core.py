"""Chat completions' wire models and the chat generation both chat routes run: /v1/chat/completions (chat.py) and
/v1/responses (responses.py), which reads a Responses request as a chat request.

`start` renders the messages with the engine's chat template (with the tools, when a tool_choice is in force),
tokenizes there and starts n engine requests; `ChatGeneration` reads their outputs as chat: one response, or
chunks (`ChatChunks`). Tool calls are parsed out of each choice's text (tools.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from server.engine.api import MAX_LOGPROBS, GenerationOutput, RequestError
from server.openai import logprobs as lp
from server.openai import tools
from server.openai.choices import Choice, usage
from server.openai.generation import Generation, WaitForDisconnect
from server.openai.protocol import ChatMessage, Usage
from server.openai.sampling import SamplingFields
from server.openai.served import ServedModels
from server.openai.tools import DeltaToolCall, NamedToolChoice, Tool, ToolCallOut


class ChatCompletionRequest(SamplingFields):
    ENDPOINT: ClassVar[str] = "chat"
    PROMPT_FIELD: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # 0..20 alternatives per token; needs logprobs
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call

    def max_tokens_asked(self) -> int | None:
        """max_completion_tokens, or the older max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """`logprobs: true` with `top_logprobs` alternatives per token; vLLM's prompt_logprobs as given."""
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise RequestError("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        return (self.top_logprobs or 0) if self.logprobs else None, self.prompt_logprobs

    def param_name(self, field_name: str) -> str:
        if field_name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().param_name(field_name)

    def prompt_chars(self) -> list[int]:
        """The characters of all messages together."""
        return [sum(len(m.text()) for m in self.messages)]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: lp.ChatLogprobs | None = None
    prompt_logprobs: list[dict[str, lp.PromptLogprob] | None] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: lp.ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


@dataclass(slots=True)
class ChatGeneration:
    """A chat request's engine requests, started, and how their outputs read as chat (the Responses API reads
    them too: responses.py)."""

    request: ChatCompletionRequest
    generation: Generation
    tool_choice: str | None  # the effective one (tools.choice_of)
    parser: tools.ToolParser | None

    def chunks(self) -> ChatChunks:
        return ChatChunks(self.request, self.generation.request_id, self.tool_choice, self.parser)

    def response(self, choices: list[Choice]) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=f"chatcmpl-{self.generation.request_id}",
            model=self.request.model,
            usage=usage(choices, self.request.n),
            choices=[
                _chat_choice(self.request, i, c, self.tool_choice, self.parser) for i, c in enumerate(choices)
            ],
        )


async def start(
    served: ServedModels,
    tool_call_parser: str | None,
    request: ChatCompletionRequest,
    client_gone: WaitForDisconnect,
) -> ChatGeneration:
    """Render the messages (with the tools when a tool_choice is in force), tokenize and submit; errors a client
    can fix raise OpenAIError naming the field."""
    engine = served.engine_for(request)
    try:
        tool_choice = tools.choice_of(request, tool_call_parser)
    except RequestError as exc:
        served.refuse_field(request, exc)
    messages = [m.turn() for m in request.messages]
    described = None  # the tools, for the template (no tool_choice: not shown to the model)
    if tool_choice is not None:
        described = [tool.model_dump(mode="json", exclude_none=True) for tool in request.tools or ()]

    def render(turns: list[dict[str, Any]]) -> list[int]:
        return engine.apply_chat_template(turns, described)

    def prompts() -> list[list[int]]:
        return [served.tokenize(request.model, request.PROMPT_FIELD, render, messages)]

    if request.top_logprobs is not None and not request.logprobs:
        served.refuse(request.model, "top_logprobs: needs `logprobs: true`", "top_logprobs")
    generation = await served.start(
        request, engine, prompts, client_gone, tools.grammar(request, tool_choice)
    )
    parser = None if tool_call_parser is None else tools.PARSERS[tool_call_parser]()
    return ChatGeneration(request, generation, tool_choice, parser)


class ChatChunks:
    def __init__(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        tool_choice: str | None = None,
        parser: tools.ToolParser | None = None,
    ) -> None:
        self._id = f"chatcmpl-{request_id}"
        self._model = request.model
        self._created = int(time.time())
        self._logprobs = request.logprobs
        self._tool_choice = tool_choice
        self._parser = parser
        self._calls: dict[int, tools.StreamedCalls] = {}

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self._id, created=self._created, model=self._model, choices=choices, usage=usage
        )

    def for_output(self, index: int, output: GenerationOutput, first: bool) -> list[Any]:
        out = []
        if first:
            out.append(
                self._chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            )
        logprobs = lp.chat(output.logprobs) if self._logprobs and output.logprobs else None
        text, calls, reason = output.new_text, None, output.finish_reason
        if self._tool_choice is not None:
            streamed = self._calls.setdefault(index, tools.StreamedCalls(self._tool_choice, self._parser))
            text, deltas = streamed.feed(text, output.finished)
            calls = deltas or None
            reason = _tool_finish_reason(self._tool_choice, streamed.made_calls, reason)
        if text or calls or output.finished or logprobs is not None:
            delta = DeltaMessage(content=text or None, tool_calls=calls)
            choice = ChatChunkChoice(index=index, delta=delta, finish_reason=reason, logprobs=logprobs)
            out.append(self._chunk([choice]))
        return out

    def usage(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)


def _tool_finish_reason(tool_choice: str, made_calls: bool, reason: str | None) -> str | None:
    """OpenAI's: "tool_calls" when auto or required ended with calls; a named tool_choice ends with "stop"."""
    if reason == "stop" and made_calls and tool_choice in ("auto", "required"):
        return "tool_calls"
    return reason


def _chat_choice(
    request: ChatCompletionRequest,
    index: int,
    choice: Choice,
    tool_choice: str | None,
    parser: tools.ToolParser | None,
) -> ChatChoice:
    text, calls, reason = "".join(choice.text), [], choice.finish_reason
    if tool_choice is not None:  # the whole answer through the stream's parsing, at once
        streamed = tools.StreamedCalls(tool_choice, parser)
        text, _ = streamed.feed(text, finished=True)
        calls, reason = streamed.calls, _tool_finish_reason(tool_choice, streamed.made_calls, reason)
    return ChatChoice(
        index=index,
        message=AssistantMessage(
            content=text or (None if calls else ""), tool_calls=tools.tool_calls(calls) or None
        ),
        finish_reason=reason,
        logprobs=lp.chat(choice.logprobs) if request.logprobs else None,
        prompt_logprobs=lp.prompt_logprobs(request, choice.prompt_logprobs),
    )
