"""The sampling fields chat and completions share, and the engine's `SamplingParams` made from them.

Field names and defaults follow the OpenAI API reference; vLLM's extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `prompt_logprobs`, `skip_special_tokens`, ...)
and its `cache_salt` are accepted as well, as `extra_body` of the official client sends them. The declared fields
are the honored ones; every other field is refused by name (`fields.py`), never ignored.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec
from pydantic import ConfigDict, Field

from server.engine.api import (
    SAMPLING_FIELDS,
    Engine,
    RequestError,
    SamplingParams,
    StructuredOutput,
    max_output_tokens,
    structured_outputs,
    structured_spec,
)
from server.openai.protocol import StrictRequest


class StreamOptions(StrictRequest):
    model_config = ConfigDict(extra="forbid", strict=True)  # vLLM's continuous_usage_stats is not implemented

    include_usage: bool = False


class JSONSchemaFormat(StrictRequest):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(StrictRequest):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object), json_schema."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(StrictRequest):
    """Fields shared by /v1/completions and /v1/chat/completions; `None` means the engine's default.

    Each endpoint's request model sets ENDPOINT and PROMPT_FIELD and says how its own fields read (the methods
    below), so the code shared by both never asks which endpoint a request came from."""

    ENDPOINT: ClassVar[str]  # "chat" or "completions" (fields.ENDPOINT_DEFAULTS)
    PROMPT_FIELD: ClassVar[str]  # the field holding the prompt: "messages" or "prompt"

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
    priority: int = 0  # vLLM's: lower runs first; an engine whose scheduling_policy is fcfs takes only 0

    def max_tokens_asked(self) -> int | None:
        """The client's bound on generated tokens (tokens); None: as many as the context leaves."""
        return self.max_tokens

    def max_tokens_generated(self) -> int | None:
        """The bound the engine gets (tokens): the one asked for."""
        return self.max_tokens_asked()

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) for the engine: alternatives per output token and per prompt token, None
        for none; RequestError naming the field."""
        raise NotImplementedError

    def param_name(self, field_name: str) -> str:
        """The engine's field name as the client spelled it."""
        if field_name in ("prompt_token_ids", "prompt"):
            return self.PROMPT_FIELD
        return field_name

    def num_prompts(self) -> int:
        """How many prompts the request holds (each gets n choices)."""
        return 1

    def prompt_chars(self) -> list[int]:
        """Characters of each text prompt; token-id prompts are not counted."""
        raise NotImplementedError


def sampling_params(
    request: SamplingFields, engine: Engine, token_ids: list[int], tool_grammar: StructuredOutput | None
) -> list[SamplingParams]:
    """One SamplingParams per choice of the prompt `token_ids`; choice j gets seed + j, so n choices differ yet stay
    reproducible. Raises RequestError naming the engine's field (`request.param_name` spells it as the client did).

    max_tokens defaults to its limit (`max_output_tokens`: the room the context leaves, capped by the engine).
    """
    raw: dict[str, Any] = {name: getattr(request, name, None) for name in SAMPLING_FIELDS}
    raw["logprobs"], raw["prompt_logprobs"] = request.logprob_counts()
    if request.logit_bias is not None:
        raw["logit_bias"] = dict(request.logit_bias)
    raw["structured_outputs"] = _structured(request, tool_grammar)
    requested = request.max_tokens_generated()
    limit = max_output_tokens(engine, len(token_ids))
    raw["max_tokens"] = limit if requested is None else requested  # 0 is an error, not "use the default"
    base = SamplingParams.from_dict(raw, max_tokens_limit=limit)
    if base.seed is None:
        return [msgspec.structs.replace(base) for _ in range(request.n)]
    return [msgspec.structs.replace(base, seed=base.seed + j) for j in range(request.n)]


_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _structured(request: SamplingFields, tool_grammar: StructuredOutput | None) -> StructuredOutput | None:
    """The request's grammar: a forced tool call's, OpenAI's response_format, vLLM's structured_outputs or its older
    guided_* (one of them at most); RequestError naming the field."""
    given = [
        name
        for name in ("response_format", "structured_outputs", *_GUIDED)
        if getattr(request, name) is not None
    ]
    if request.response_format is not None and request.response_format.type == "text":
        given.remove("response_format")
    if tool_grammar is not None:
        if given:
            raise RequestError(given[0], "a forced tool call (tool_choice) has its own grammar")
        return tool_grammar
    if len(given) > 1:
        raise RequestError(given[1], f"give one of {', '.join(given)}, not several")
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        form = request.response_format
        if form.type == "json_object":
            return structured_spec("response_format", "json_object", None)
        if form.json_schema is None:
            raise RequestError("response_format.json_schema", "required with type json_schema")
        return structured_spec("response_format.json_schema.schema", "json", form.json_schema.schema_)
    if name == "structured_outputs":
        return structured_outputs("structured_outputs", request.structured_outputs)
    return structured_spec(name, _GUIDED[name], getattr(request, name))
