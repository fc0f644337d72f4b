"""The OpenAI API's logic: validate, tokenize, submit n engine requests per prompt, shape the answer.

Non-streaming calls return a response model; streaming calls return an async iterator of SSE lines
(`data: {...}\\n\\n`, then `data: [DONE]\\n\\n`). Errors a client can fix raise `OpenAIError` with the OpenAI
status, type and the offending parameter; a full wait queue is a 429 with Retry-After; an engine failure of one
request is a 500 with the engine's reason (exception type and message; tracebacks stay in the server log).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from pydantic import BaseModel

from server.engine.api import (
    SAMPLING_FIELDS,
    Engine,
    EngineOverloaded,
    EngineUnavailable,
    GenerationOutput,
    RequestError,
    SamplingParams,
    max_output_tokens,
    validate_cache_salt,
)
from server.openai import protocol as p
from server.openai.generation import ClientDisconnected, Generation, WaitForDisconnect
from server.openai.metrics import FrontendMetrics

logger = logging.getLogger(__name__)

# Fields of the OpenAI API that Strata does not implement: refused by name rather than silently ignored.
_UNSUPPORTED = (
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "logit_bias",
    "tools",
    "functions",
    "response_format",
)


class OpenAIError(Exception):
    """An error the API returns as `{"error": {...}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = p.ErrorInfo(message=message, type=type_, param=param, code=code)
        self.headers = headers


def internal_error(reason: str | None = None) -> OpenAIError:
    """500; `reason` is an engine's own account of a failed request (GenerationOutput.error)."""
    return OpenAIError(500, reason or "internal server error; see the server log", "internal_server_error")


def overloaded(model: str, exc: EngineOverloaded) -> OpenAIError:
    """429 with Retry-After (whole seconds, at least 1): the engine's wait queue is full."""
    return OpenAIError(
        429,
        f"model `{model}` is overloaded: {exc}",
        type_="rate_limit_exceeded",
        code="queue_full",
        headers={"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))},
    )


@dataclass(slots=True)
class _Choice:
    """What one engine request (one choice) has produced so far."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    started: bool = False


class OpenAIServing:
    def __init__(self, models: Mapping[str, Engine], metrics: FrontendMetrics) -> None:
        self._models = models  # live view: the server adds and removes models as the repository changes
        self._metrics = metrics
        self._created = int(time.time())

    def list_models(self) -> p.ModelList:
        cards = [
            p.ModelCard(id=name, created=self._created, max_model_len=engine.max_model_len)
            for name, engine in self._models.items()
        ]
        return p.ModelList(data=cards)

    def count_invalid(self, model: str) -> None:
        """Count a request refused before it reached serving (malformed JSON, schema errors)."""
        self._metrics.requests.labels(model if model in self._models else "", "invalid").inc()

    async def chat(
        self, request: p.ChatCompletionRequest, client_gone: WaitForDisconnect
    ) -> p.ChatCompletionResponse | AsyncIterator[str]:
        engine = self._engine(request)
        messages = [
            {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
            for m in request.messages
        ]

        def prompts() -> list[list[int]]:
            return [self._tokenize(request.model, "messages", engine.apply_chat_template, messages)]

        generation = await self._start(request, engine, prompts, client_gone)
        if request.stream:
            return self._sse(request, generation, request.n, _ChatChunks(request, generation.request_id))
        choices = await self._collect(request, generation, request.n)
        return p.ChatCompletionResponse(
            id=f"chatcmpl-{generation.request_id}",
            model=request.model,
            usage=_usage(choices, request.n),
            choices=[
                p.ChatChoice(
                    index=i,
                    message=p.AssistantMessage(content="".join(c.text)),
                    finish_reason=c.finish_reason,
                )
                for i, c in enumerate(choices)
            ],
        )

    async def completion(
        self, request: p.CompletionRequest, client_gone: WaitForDisconnect
    ) -> p.CompletionResponse | AsyncIterator[str]:
        engine = self._engine(request)
        texts = _prompt_list(request.prompt)
        if not texts:
            self._fail(request.model, 400, "the prompt list is empty", "prompt")

        def prompts() -> list[list[int]]:
            return [
                self._tokenize(request.model, "prompt", engine.encode, text)
                if isinstance(text, str)
                else text
                for text in texts
            ]

        generation = await self._start(request, engine, prompts, client_gone)
        num_choices = len(texts) * request.n
        if request.stream:
            return self._sse(
                request, generation, num_choices, _CompletionChunks(request, generation.request_id)
            )
        choices = await self._collect(request, generation, num_choices)
        return p.CompletionResponse(
            id=f"cmpl-{generation.request_id}",
            model=request.model,
            usage=_usage(choices, request.n),
            choices=[
                p.CompletionChoice(index=i, text="".join(c.text), finish_reason=c.finish_reason)
                for i, c in enumerate(choices)
            ],
        )

    def _engine(self, request: p.SamplingFields) -> Engine:
        engine = self._models.get(request.model)
        if engine is None:
            self._metrics.requests.labels("", "invalid").inc()
            raise OpenAIError(
                404, f"The model `{request.model}` does not exist", param="model", code="model_not_found"
            )
        unsupported = [
            name for name in _UNSUPPORTED if (request.model_extra or {}).get(name) not in (None, False)
        ]
        if unsupported:
            self._fail(
                request.model, 400, f"`{unsupported[0]}` is not supported by this server", unsupported[0]
            )
        return engine

    def _tokenize(
        self, model: str, param: str, tokenize: Callable[[Any], list[int]], value: Any
    ) -> list[int]:
        try:
            return tokenize(value)
        except RequestError as exc:
            self._fail(model, 400, f"{param}: {exc.message}", param)
        except EngineUnavailable as exc:
            self._metrics.requests.labels(model, "error").inc()
            raise OpenAIError(
                503,
                f"model `{model}` cannot take requests now: {exc}",
                type_="service_unavailable",
                code="engine_unavailable",
            ) from None
        except Exception:
            logger.exception("tokenizing %s failed", param)
            self._metrics.requests.labels(model, "error").inc()
            raise internal_error() from None

    def _fail(self, model: str, status: int, message: str, param: str | None) -> None:
        self._metrics.requests.labels(model, "invalid").inc()
        raise OpenAIError(status, message, param=param)

    def _fail_field(self, request: p.SamplingFields, exc: RequestError) -> None:
        param = _param_name(request, exc.field)
        self._fail(request.model, 400, f"{param}: {exc.message}", param)

    async def _start(
        self,
        request: p.SamplingFields,
        engine: Engine,
        prompts: Callable[[], list[list[int]]],
        client_gone: WaitForDisconnect,
    ) -> Generation:
        """Tokenize, validate and submit n engine requests per prompt (`{request_id}-{i}`) in one worker-thread
        hop: tokenizing and an engine's submit (a worker round trip) may block, the event loop must not. Errors
        come before the first byte, so a bad streaming request still gets its 4xx status."""
        generation = Generation(engine, self._metrics, request.model, client_gone, uuid.uuid4().hex)
        try:
            await asyncio.to_thread(self._submit, request, engine, prompts, generation)
        except BaseException:
            generation.close()
            raise
        return generation

    def _submit(
        self,
        request: p.SamplingFields,
        engine: Engine,
        prompts: Callable[[], list[list[int]]],
        generation: Generation,
    ) -> None:
        try:
            validate_cache_salt(request.cache_salt)
        except RequestError as exc:
            self._fail_field(request, exc)
        jobs = [(ids, sampling) for ids in prompts() for sampling in self._sampling(request, engine, ids)]
        try:
            generation.submit(jobs, request.cache_salt)
        except RequestError as exc:
            self._fail_field(request, exc)
        except EngineOverloaded as exc:
            self._metrics.requests.labels(request.model, "rejected").inc()
            raise overloaded(request.model, exc) from None
        except EngineUnavailable as exc:
            self._metrics.requests.labels(request.model, "error").inc()
            raise OpenAIError(
                503,
                f"model `{request.model}` cannot take requests now: {exc}",
                type_="service_unavailable",
                code="engine_unavailable",
            ) from None
        except Exception:
            self._metrics.requests.labels(request.model, "error").inc()
            raise

    def _sampling(
        self, request: p.SamplingFields, engine: Engine, token_ids: list[int]
    ) -> list[SamplingParams]:
        """One SamplingParams per choice; choice j gets seed + j, so n choices differ yet stay reproducible.

        max_tokens defaults to its limit (`max_output_tokens`: the room the context leaves, capped by the engine).
        """
        prompt_param = "messages" if isinstance(request, p.ChatCompletionRequest) else "prompt"
        if not token_ids:
            self._fail(request.model, 400, "the prompt is empty", prompt_param)
        raw: dict[str, Any] = {name: getattr(request, name) for name in SAMPLING_FIELDS}
        requested = _max_tokens(request)
        try:
            limit = max_output_tokens(engine, len(token_ids))
            raw["max_tokens"] = (
                limit if requested is None else requested
            )  # 0 is an error, not "use the default"
            base = SamplingParams.from_dict(raw, max_tokens_limit=limit)
        except RequestError as exc:
            self._fail_field(request, exc)
        if base.seed is None:
            return [msgspec.structs.replace(base) for _ in range(request.n)]
        return [msgspec.structs.replace(base, seed=base.seed + j) for j in range(request.n)]

    async def _collect(
        self, request: p.SamplingFields, generation: Generation, num_choices: int
    ) -> list[_Choice]:
        choices = [_Choice() for _ in range(num_choices)]
        status = "aborted"
        try:
            async for index, output in generation.outputs():
                _accumulate(choices[index], output)
                if output.finish_reason == "error":
                    status = "error"
                    raise internal_error(output.error)
            status = "aborted" if any(c.finish_reason == "abort" for c in choices) else "success"
            return choices
        finally:
            generation.close()
            self._metrics.requests.labels(request.model, status).inc()

    async def _sse(
        self, request: p.SamplingFields, generation: Generation, num_choices: int, chunks: _Chunks
    ) -> AsyncIterator[str]:
        choices = [_Choice() for _ in range(num_choices)]
        status = "aborted"
        try:
            async for index, output in generation.outputs():
                if output.finish_reason == "error":
                    status = "error"
                    yield _sse(p.ErrorResponse(error=internal_error(output.error).info))
                    return
                first = not choices[index].started
                _accumulate(choices[index], output)
                for chunk in chunks.for_output(index, output, first):
                    yield _sse(chunk)
            if request.stream_options and request.stream_options.include_usage:
                yield _sse(chunks.usage(_usage(choices, request.n)))
            yield "data: [DONE]\n\n"
            status = "aborted" if any(c.finish_reason == "abort" for c in choices) else "success"
        except ClientDisconnected:
            return
        finally:
            generation.close()
            self._metrics.requests.labels(request.model, status).inc()


class _Chunks(Protocol):
    """Turns engine outputs into the stream chunks of one endpoint."""

    def for_output(self, index: int, output: GenerationOutput, first: bool) -> list[Any]: ...

    def usage(self, usage: p.Usage) -> Any: ...


class _ChatChunks:
    def __init__(self, request: p.ChatCompletionRequest, request_id: str) -> None:
        self._id = f"chatcmpl-{request_id}"
        self._model = request.model
        self._created = int(time.time())

    def _chunk(self, choices: list[p.ChatChunkChoice], usage: p.Usage | None = None) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(
            id=self._id, created=self._created, model=self._model, choices=choices, usage=usage
        )

    def for_output(self, index: int, output: GenerationOutput, first: bool) -> list[Any]:
        out = []
        if first:
            out.append(
                self._chunk(
                    [p.ChatChunkChoice(index=index, delta=p.DeltaMessage(role="assistant", content=""))]
                )
            )
        if output.new_text or output.finished:
            delta = p.DeltaMessage(content=output.new_text or None)
            out.append(
                self._chunk([p.ChatChunkChoice(index=index, delta=delta, finish_reason=output.finish_reason)])
            )
        return out

    def usage(self, usage: p.Usage) -> p.ChatCompletionChunk:
        return self._chunk([], usage)


class _CompletionChunks:
    def __init__(self, request: p.CompletionRequest, request_id: str) -> None:
        self._id = f"cmpl-{request_id}"
        self._model = request.model
        self._created = int(time.time())

    def for_output(self, index: int, output: GenerationOutput, first: bool) -> list[Any]:
        if not (output.new_text or output.finished):
            return []
        choice = p.CompletionChoice(index=index, text=output.new_text, finish_reason=output.finish_reason)
        return [p.CompletionResponse(id=self._id, created=self._created, model=self._model, choices=[choice])]

    def usage(self, usage: p.Usage) -> p.CompletionResponse:
        return p.CompletionResponse(
            id=self._id, created=self._created, model=self._model, choices=[], usage=usage
        )


def _sse(model: BaseModel) -> str:
    """One server-sent event: the model serialized once, in pydantic's Rust serializer (compact UTF-8 JSON)."""
    return f"data: {model.model_dump_json()}\n\n"


def _accumulate(choice: _Choice, output: GenerationOutput) -> None:
    choice.started = True
    choice.text.append(output.new_text)
    choice.prompt_tokens = output.num_prompt_tokens or choice.prompt_tokens
    choice.cached_tokens = max(choice.cached_tokens, output.num_cached_tokens)
    choice.output_tokens = output.num_output_tokens or choice.output_tokens
    if output.finished:
        choice.finish_reason = output.finish_reason


def _usage(choices: list[_Choice], n: int) -> p.Usage:
    """The prompt counts once per prompt (not per choice), as OpenAI does; cached tokens are the first choice's."""
    firsts = choices[::n]
    prompt = sum(c.prompt_tokens for c in firsts)
    completion = sum(c.output_tokens for c in choices)
    return p.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=sum(c.cached_tokens for c in firsts)),
    )


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def _max_tokens(request: p.SamplingFields) -> int | None:
    if isinstance(request, p.ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


def _param_name(request: p.SamplingFields, field_name: str) -> str:
    """The engine's field name as the client spelled it."""
    if (
        field_name == "max_tokens"
        and isinstance(request, p.ChatCompletionRequest)
        and request.max_completion_tokens is not None
    ):
        return "max_completion_tokens"
    if field_name in ("prompt_token_ids", "prompt"):
        return "messages" if isinstance(request, p.ChatCompletionRequest) else "prompt"
    return field_name
