"""Wire models of the OpenAI-compatible API (requests validated by pydantic, responses serialized from these).

Field names and defaults follow the OpenAI API reference; vLLM's extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `prompt_logprobs`, `skip_special_tokens`, ...)
and its `cache_salt` are accepted as well, as `extra_body` of the official client sends them. The declared fields
are the honored ones; every other field is refused by name (`fields.py`), never ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError


class _Request(BaseModel):
    """Strict: a string where a number belongs is a 400 naming the field, not a silent coercion. Text must be valid
    Unicode: JSON can escape a lone surrogate (`"\\ud800"`), which no tokenizer or UTF-8 encoder takes."""

    model_config = ConfigDict(extra="allow", strict=True)

    @field_validator("*")
    @classmethod
    def _no_lone_surrogates(cls, value: Any) -> Any:
        if not _encodable(value):
            raise PydanticCustomError(
                "unicode", "must be valid Unicode text (a lone surrogate such as \\ud800 is not)"
            )
        return value


def _encodable(value: Any) -> bool:
    """Every string in `value` (str, or lists of them; models check their own fields) encodes as UTF-8."""
    if isinstance(value, str):
        if value.isascii():
            return True
        try:
            value.encode()
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, list):
        return all(_encodable(item) for item in value)
    return True


class StreamOptions(_Request):
    model_config = ConfigDict(extra="forbid", strict=True)  # vLLM's continuous_usage_stats is not implemented

    include_usage: bool = False


class JSONSchemaFormat(_Request):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(_Request):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object), json_schema."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions; `None` means the engine's default."""

    model: str
    n: int = Field(1, ge=1)  # at most --max-n (server.openai.limits)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias added to its logit
    prompt_logprobs: int | None = (
        None  # vLLM's: logprobs of the prompt's tokens, in the choice's prompt_logprobs
    )
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = (
        None  # vLLM's: one of json, regex, choice, grammar, json_object
    )
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = (
        None  # the end user's id (OpenAI's, for abuse monitoring): accepted, it changes nothing
    )
    cache_salt: str | None = (
        None  # prefix-cache blocks are shared only among requests with this salt (vLLM's)
    )


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Request):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCallIn(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class FunctionDef(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # forced calls always follow `parameters` here


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # 0..20 alternatives per token; needs logprobs
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # 0..20: each token's logprob and that many alternatives (the legacy shape)
    echo: bool = False  # the prompt before the completion, in the text and, with logprobs, in the logprobs
    best_of: int | None = None  # accepted when equal to n (no choices are dropped)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: one entry per token of `text`; the first prompt token's logprob and alternatives
    are null; `text_offset` is each token's start in `text`, in characters."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`: {token id: this}; the prompt token itself and its top alternatives."""

    logprob: float
    rank: int | None = None  # 1 is the most likely; null for the prompt token when it is not among the top
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


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


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "strata"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletion(_Request):
    """POST /tokenize with a prompt (vLLM's shape); `model` may be left out when one model is served."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(_Request):
    """POST /tokenize with chat messages: the tokens of the rendered template, ending with the assistant's turn."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class DisaggThresholds(BaseModel):
    """Conditional disaggregation's thresholds of one model (`strata serve --max-local-prefill-length`,
    `--max-prefill-queue-size`); in a PUT, a field left out keeps its value."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_local_prefill_length: int | None = Field(None, ge=0, le=1 << 31)
    max_prefill_queue_size: int | None = Field(None, ge=0, le=1 << 31)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a response model (None fields kept: clients expect `logprobs: null`)."""
    return model.model_dump(mode="json")
