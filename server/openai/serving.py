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
    MAX_LOGPROBS,
    SAMPLING_FIELDS,
    Engine,
    EngineOverloaded,
    EngineUnavailable,
    GenerationOutput,
    RequestError,
    SamplingParams,
    StructuredOutput,
    TokenLogprobs,
    max_output_tokens,
    structured_outputs,
    structured_spec,
    validate_cache_salt,
)
from server.openai import logprobs as lp
from server.openai import protocol as p
from server.openai import tools
from server.openai.fields import refused_field
from server.openai.generation import ClientDisconnected, Generation, WaitForDisconnect
from server.openai.metrics import FrontendMetrics

logger = logging.getLogger(__name__)


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


def failed(output: GenerationOutput) -> OpenAIError:
    """A request that ended with an error: 503 when it was retryable (its worker or ranks failed and no other
    could resume it: the client may retry), else 500 with the engine's account."""
    if output.retryable:
        return OpenAIError(
            503,
            f"the request could not be finished now ({output.error}); retry",
            type_="service_unavailable",
            code="engine_unavailable",
        )
    return internal_error(output.error)


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
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(slots=True)
class _Echo:
    """What completions' `echo` puts before each prompt's choices: the prompt's text and its first token's text."""

    texts: list[str]
    first_tokens: list[str]
    prompt_only: bool  # max_tokens 0: the prompt and nothing generated


class OpenAIServing:
    def __init__(
        self, models: Mapping[str, Engine], metrics: FrontendMetrics, tool_call_parser: str | None = None
    ) -> None:
        """`tool_call_parser`: the parser of tool_choice auto's answers (vLLM's --tool-call-parser, given with
        --enable-auto-tool-choice); None refuses auto."""
        if tool_call_parser is not None and tool_call_parser not in tools.PARSERS:
            raise ValueError(
                f"--tool-call-parser {tool_call_parser!r}: known parsers are {sorted(tools.PARSERS)}"
            )
        self._models = models  # live view: the server adds and removes models as the repository changes
        self._metrics = metrics
        self._tool_parser = tool_call_parser
        self._created = int(time.time())

    def list_models(self) -> p.ModelList:
        cards = [
            p.ModelCard(id=name, created=self._created, max_model_len=engine.max_model_len)
            for name, engine in self._models.items()
        ]
        return p.ModelList(data=cards)

    def model_card(self, name: str) -> p.ModelCard:
        engine = self._models.get(name)
        if engine is None:
            raise OpenAIError(
                404, f"The model `{name}` does not exist", param="model", code="model_not_found"
            )
        return p.ModelCard(id=name, created=self._created, max_model_len=engine.max_model_len)

    def _named(self, model: str | None) -> tuple[str, Engine]:
        """The engine a tokenizer route names; with one model served, `model` may be left out (vLLM's)."""
        if model is None:
            if len(self._models) != 1:
                raise OpenAIError(400, "model: required when more than one model is served", param="model")
            model = next(iter(self._models))
        self.model_card(model)  # 404 for an unknown one
        return model, self._models[model]

    async def tokenize(self, request: p.TokenizeCompletion | p.TokenizeChat) -> p.TokenizeResponse:
        model, engine = self._named(request.model)
        if isinstance(request, p.TokenizeChat):
            if not request.add_generation_prompt:
                raise OpenAIError(
                    400, "add_generation_prompt: only true is supported", param="add_generation_prompt"
                )
            messages = [_turn(m) for m in request.messages]  # as chat completions renders them
            ids = await asyncio.to_thread(
                self._tokenize, model, "messages", engine.apply_chat_template, messages
            )
        else:
            if not request.add_special_tokens:
                raise OpenAIError(
                    400, "add_special_tokens: only true is supported", param="add_special_tokens"
                )
            ids = await asyncio.to_thread(self._tokenize, model, "prompt", engine.encode, request.prompt)
        strs = None
        if request.return_token_strs:
            strs = [await asyncio.to_thread(self._decode, model, engine, [t]) for t in ids]
        return p.TokenizeResponse(
            count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs
        )

    async def detokenize(self, request: p.DetokenizeRequest) -> p.DetokenizeResponse:
        model, engine = self._named(request.model)
        if any(t < 0 for t in request.tokens):
            raise OpenAIError(400, "tokens: token ids are not negative", param="tokens")
        return p.DetokenizeResponse(
            prompt=await asyncio.to_thread(self._decode, model, engine, request.tokens)
        )

    def _label(self, model: str) -> str:
        """The name `model`'s series carry: its engine's first served name (served_model_name's first, as
        vLLM's metrics), whichever of its names the request used."""
        engine = self._models.get(model)
        if engine is None:
            return model
        return next((name for name, served in self._models.items() if served is engine), model)

    def count_invalid(self, model: str) -> None:
        """Count a request refused before it reached serving (malformed JSON, schema errors)."""
        self._metrics.requests.labels(model if model in self._models else "", "invalid").inc()

    async def chat(
        self, request: p.ChatCompletionRequest, client_gone: WaitForDisconnect
    ) -> p.ChatCompletionResponse | AsyncIterator[str]:
        engine = self._engine(request)
        try:
            tool_choice = tools.choice_of(request, self._tool_parser)
        except RequestError as exc:
            self._fail_field(request, exc)
        messages = [_turn(m) for m in request.messages]
        described = None  # the tools, for the template (no tool_choice: not shown to the model)
        if tool_choice is not None:
            described = [tool.model_dump(mode="json", exclude_none=True) for tool in request.tools or ()]

        def render(turns: list[dict[str, Any]]) -> list[int]:
            return engine.apply_chat_template(turns, described)

        def prompts() -> list[list[int]]:
            return [self._tokenize(request.model, "messages", render, messages)]

        if request.top_logprobs is not None and not request.logprobs:
            self._fail(request.model, 400, "top_logprobs: needs `logprobs: true`", "top_logprobs")
        generation = await self._start(
            request, engine, prompts, client_gone, tools.grammar(request, tool_choice)
        )
        parser = self._parser()
        if request.stream:
            chunks = _ChatChunks(request, generation.request_id, tool_choice, parser)
            return self._sse(request, generation, request.n, chunks)
        choices = await self._collect(request, generation, request.n)
        return p.ChatCompletionResponse(
            id=f"chatcmpl-{generation.request_id}",
            model=request.model,
            usage=_usage(choices, request.n),
            choices=[_chat_choice(request, i, c, tool_choice, parser) for i, c in enumerate(choices)],
        )

    def _parser(self) -> tools.ToolParser | None:
        return None if self._tool_parser is None else tools.PARSERS[self._tool_parser]()

    async def completion(
        self, request: p.CompletionRequest, client_gone: WaitForDisconnect
    ) -> p.CompletionResponse | AsyncIterator[str]:
        engine = self._engine(request)
        texts = _prompt_list(request.prompt)
        if not texts:
            self._fail(request.model, 400, "the prompt list is empty", "prompt")

        echo = _Echo([], [], request.echo and _max_tokens(request) == 0) if request.echo else None
        if request.best_of is not None and request.best_of != request.n:
            self._fail(request.model, 400, "best_of: only best_of equal to n is supported", "best_of")

        def prompts() -> list[list[int]]:
            ids = [
                self._tokenize(request.model, "prompt", engine.encode, text)
                if isinstance(text, str)
                else text
                for text in texts
            ]
            if echo is not None:  # the prompt as the client sent it, or its ids decoded
                echo.texts = [
                    t if isinstance(t, str) else self._decode(request.model, engine, t) for t in texts
                ]
                echo.first_tokens = [self._decode(request.model, engine, i[:1]) for i in ids]
            return ids

        generation = await self._start(request, engine, prompts, client_gone)
        num_choices = len(texts) * request.n
        if request.stream:
            return self._sse(
                request, generation, num_choices, _CompletionChunks(request, generation.request_id, echo)
            )
        choices = await self._collect(request, generation, num_choices)
        return p.CompletionResponse(
            id=f"cmpl-{generation.request_id}",
            model=request.model,
            usage=_usage(choices, request.n, echo is not None and echo.prompt_only),
            choices=[_completion_choice(request, echo, i, c) for i, c in enumerate(choices)],
        )

    def _engine(self, request: p.SamplingFields) -> Engine:
        engine = self._models.get(request.model)
        if engine is None:
            self._metrics.requests.labels("", "invalid").inc()
            raise OpenAIError(
                404, f"The model `{request.model}` does not exist", param="model", code="model_not_found"
            )
        endpoint = "chat" if isinstance(request, p.ChatCompletionRequest) else "completions"
        refused = refused_field(request.model_extra, endpoint)
        if refused is not None:
            self._fail(request.model, 400, refused[1], refused[0])
        return engine

    def _decode(self, model: str, engine: Engine, token_ids: list[int]) -> str:
        try:
            return engine.decode(token_ids)
        except Exception:
            logger.exception("decoding a prompt for echo failed")
            self._metrics.requests.labels(self._label(model), "error").inc()
            raise internal_error() from None

    def _tokenize(
        self, model: str, param: str, tokenize: Callable[[Any], list[int]], value: Any
    ) -> list[int]:
        try:
            return tokenize(value)
        except RequestError as exc:
            self._fail(model, 400, f"{param}: {exc.message}", param)
        except EngineUnavailable as exc:
            self._metrics.requests.labels(self._label(model), "error").inc()
            raise OpenAIError(
                503,
                f"model `{model}` cannot take requests now: {exc}",
                type_="service_unavailable",
                code="engine_unavailable",
            ) from None
        except Exception:
            logger.exception("tokenizing %s failed", param)
            self._metrics.requests.labels(self._label(model), "error").inc()
            raise internal_error() from None

    def _fail(self, model: str, status: int, message: str, param: str | None) -> None:
        self._metrics.requests.labels(self._label(model), "invalid").inc()
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
        tool_grammar: StructuredOutput | None = None,
    ) -> Generation:
        """Tokenize, validate and submit n engine requests per prompt (`{request_id}-{i}`) in one worker-thread
        hop: tokenizing and an engine's submit (a worker round trip) may block, the event loop must not. Errors
        come before the first byte, so a bad streaming request still gets its 4xx status."""
        generation = Generation(
            engine, self._metrics, self._label(request.model), client_gone, uuid.uuid4().hex
        )
        try:
            await asyncio.to_thread(self._submit, request, engine, prompts, generation, tool_grammar)
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
        tool_grammar: StructuredOutput | None,
    ) -> None:
        try:
            validate_cache_salt(request.cache_salt)
        except RequestError as exc:
            self._fail_field(request, exc)
        jobs = [
            (ids, sampling)
            for ids in prompts()
            for sampling in self._sampling(request, engine, ids, tool_grammar)
        ]
        try:
            generation.submit(jobs, request.cache_salt)
        except RequestError as exc:
            self._fail_field(request, exc)
        except EngineOverloaded as exc:
            self._metrics.requests.labels(self._label(request.model), "rejected").inc()
            raise overloaded(request.model, exc) from None
        except EngineUnavailable as exc:
            self._metrics.requests.labels(self._label(request.model), "error").inc()
            raise OpenAIError(
                503,
                f"model `{request.model}` cannot take requests now: {exc}",
                type_="service_unavailable",
                code="engine_unavailable",
            ) from None
        except Exception:
            self._metrics.requests.labels(self._label(request.model), "error").inc()
            raise

    def _sampling(
        self,
        request: p.SamplingFields,
        engine: Engine,
        token_ids: list[int],
        tool_grammar: StructuredOutput | None = None,
    ) -> list[SamplingParams]:
        """One SamplingParams per choice; choice j gets seed + j, so n choices differ yet stay reproducible.

        max_tokens defaults to its limit (`max_output_tokens`: the room the context leaves, capped by the engine).
        """
        prompt_param = "messages" if isinstance(request, p.ChatCompletionRequest) else "prompt"
        if not token_ids:
            self._fail(request.model, 400, "the prompt is empty", prompt_param)
        raw: dict[str, Any] = {name: getattr(request, name, None) for name in SAMPLING_FIELDS}
        try:
            raw["logprobs"], raw["prompt_logprobs"] = _logprob_counts(request)
        except RequestError as exc:
            self._fail_field(request, exc)
        if request.logit_bias is not None:
            raw["logit_bias"] = dict(request.logit_bias)
        try:
            raw["structured_outputs"] = _structured(request, tool_grammar)
        except RequestError as exc:
            self._fail_field(request, exc)
        requested = _max_tokens(request)
        if requested == 0 and isinstance(request, p.CompletionRequest) and request.echo:
            requested = 1  # the prompt only: its one generated token is not returned
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
                    raise failed(output)
            status = "aborted" if any(c.finish_reason == "abort" for c in choices) else "success"
            return choices
        finally:
            generation.close()
            self._metrics.requests.labels(self._label(request.model), status).inc()

    async def _sse(
        self, request: p.SamplingFields, generation: Generation, num_choices: int, chunks: _Chunks
    ) -> AsyncIterator[str]:
        choices = [_Choice() for _ in range(num_choices)]
        status = "aborted"
        try:
            async for index, output in generation.outputs():
                if output.finish_reason == "error":
                    status = "error"
                    yield _sse(p.ErrorResponse(error=failed(output).info))
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
            self._metrics.requests.labels(self._label(request.model), status).inc()


class _Chunks(Protocol):
    """Turns engine outputs into the stream chunks of one endpoint."""

    def for_output(self, index: int, output: GenerationOutput, first: bool) -> list[Any]: ...

    def usage(self, usage: p.Usage) -> Any: ...


class _ChatChunks:
    def __init__(
        self,
        request: p.ChatCompletionRequest,
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
        logprobs = lp.chat(output.logprobs) if self._logprobs and output.logprobs else None
        text, calls, reason = output.new_text, None, output.finish_reason
        if self._tool_choice is not None:
            streamed = self._calls.setdefault(index, tools.StreamedCalls(self._tool_choice, self._parser))
            text, deltas = streamed.feed(text, output.finished)
            calls = deltas or None
            reason = _tool_finish_reason(self._tool_choice, streamed.made_calls, reason)
        if text or calls or output.finished or logprobs is not None:
            delta = p.DeltaMessage(content=text or None, tool_calls=calls)
            choice = p.ChatChunkChoice(index=index, delta=delta, finish_reason=reason, logprobs=logprobs)
            out.append(self._chunk([choice]))
        return out

    def usage(self, usage: p.Usage) -> p.ChatCompletionChunk:
        return self._chunk([], usage)


class _CompletionChunks:
    """With echo, each choice's first chunk is its prompt (and the prompt's logprobs); then its completion's
    pieces, each with its tokens' logprobs (nothing of them when the prompt is all that was asked for)."""

    def __init__(self, request: p.CompletionRequest, request_id: str, echo: _Echo | None) -> None:
        self._id = f"cmpl-{request_id}"
        self._model = request.model
        self._created = int(time.time())
        self._n = request.n
        self._echo = echo
        self._logprobs = request.logprobs is not None
        self._offsets: dict[int, lp.CompletionLogprobs] = {}

    def for_output(self, index: int, output: GenerationOutput, first: bool) -> list[Any]:
        out = []
        offsets = self._offsets.setdefault(index, lp.CompletionLogprobs())
        echo = self._echo
        if first and echo is not None:
            prompt = index // self._n
            logprobs = None
            if self._logprobs and output.prompt_logprobs is not None:
                logprobs = offsets.piece(lp.echoed(echo.first_tokens[prompt], output.prompt_logprobs))
            out.append(
                self._response(p.CompletionChoice(index=index, text=echo.texts[prompt], logprobs=logprobs))
            )
        text, tokens = output.new_text, output.logprobs or []
        if echo is not None and echo.prompt_only:
            text, tokens = "", []
        logprobs = offsets.piece(lp.generated(tokens)) if self._logprobs and tokens else None
        if text or output.finished or logprobs is not None:
            choice = p.CompletionChoice(
                index=index, text=text, finish_reason=output.finish_reason, logprobs=logprobs
            )
            out.append(self._response(choice))
        return out

    def _response(self, choice: p.CompletionChoice) -> p.CompletionResponse:
        return p.CompletionResponse(id=self._id, created=self._created, model=self._model, choices=[choice])

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
    if output.logprobs:
        choice.logprobs.extend(output.logprobs)
    if output.prompt_logprobs is not None:
        choice.prompt_logprobs = output.prompt_logprobs
    choice.prompt_tokens = output.num_prompt_tokens or choice.prompt_tokens
    choice.cached_tokens = max(choice.cached_tokens, output.num_cached_tokens)
    choice.output_tokens = output.num_output_tokens or choice.output_tokens
    if output.finished:
        choice.finish_reason = output.finish_reason


def _usage(choices: list[_Choice], n: int, prompt_only: bool = False) -> p.Usage:
    """The prompt counts once per prompt (not per choice), as OpenAI does; cached tokens are the first choice's.
    `prompt_only`: echo with max_tokens 0, whose generated tokens are not returned (nor counted)."""
    firsts = choices[::n]
    prompt = sum(c.prompt_tokens for c in firsts)
    completion = 0 if prompt_only else sum(c.output_tokens for c in choices)
    return p.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=sum(c.cached_tokens for c in firsts)),
    )


def _turn(message: p.ChatMessage) -> dict[str, Any]:
    """A chat message as the engine API's turn dict."""
    turn: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name:
        turn["name"] = message.name
    if message.tool_calls:
        turn["tool_calls"] = [call.model_dump(mode="json") for call in message.tool_calls]
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _tool_finish_reason(tool_choice: str, made_calls: bool, reason: str | None) -> str | None:
    """OpenAI's: "tool_calls" when auto or required ended with calls; a named tool_choice ends with "stop"."""
    if reason == "stop" and made_calls and tool_choice in ("auto", "required"):
        return "tool_calls"
    return reason


def _chat_choice(
    request: p.ChatCompletionRequest,
    index: int,
    choice: _Choice,
    tool_choice: str | None,
    parser: tools.ToolParser | None,
) -> p.ChatChoice:
    text, calls, reason = "".join(choice.text), [], choice.finish_reason
    if tool_choice is not None:  # the whole answer through the stream's parsing, at once
        streamed = tools.StreamedCalls(tool_choice, parser)
        text, _ = streamed.feed(text, finished=True)
        calls, reason = streamed.calls, _tool_finish_reason(tool_choice, streamed.made_calls, reason)
    return p.ChatChoice(
        index=index,
        message=p.AssistantMessage(
            content=text or (None if calls else ""), tool_calls=tools.tool_calls(calls) or None
        ),
        finish_reason=reason,
        logprobs=lp.chat(choice.logprobs) if request.logprobs else None,
        prompt_logprobs=_vllm_prompt_logprobs(request, choice),
    )


def _completion_choice(request: p.CompletionRequest, echo: _Echo | None, index: int, choice: _Choice):
    """One choice of a non-streaming completion: the prompt first with echo, the legacy logprobs with
    `logprobs`, vLLM's prompt_logprobs with `prompt_logprobs`."""
    generated = "" if echo is not None and echo.prompt_only else "".join(choice.text)
    tokens = [] if echo is not None and echo.prompt_only else choice.logprobs
    text, logprobs = generated, None
    if request.logprobs is not None:
        pieces = lp.generated(tokens)
        if echo is not None and choice.prompt_logprobs is not None:
            pieces = lp.echoed(echo.first_tokens[index // request.n], choice.prompt_logprobs) + pieces
        logprobs = lp.CompletionLogprobs().piece(pieces)
    if echo is not None:
        text = echo.texts[index // request.n] + generated
    return p.CompletionChoice(
        index=index,
        text=text,
        finish_reason=choice.finish_reason,
        logprobs=logprobs,
        prompt_logprobs=_vllm_prompt_logprobs(request, choice),
    )


def _vllm_prompt_logprobs(request: p.SamplingFields, choice: _Choice) -> list | None:
    if request.prompt_logprobs is None or choice.prompt_logprobs is None:
        return None
    return lp.vllm_prompt(choice.prompt_logprobs)


_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _structured(request: p.SamplingFields, tool_grammar: StructuredOutput | None) -> StructuredOutput | None:
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


def _logprob_counts(request: p.SamplingFields) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) for the engine: alternatives per output token and per prompt token, None for
    none. Chat's are `logprobs: true` with `top_logprobs`; completions' `logprobs: k`, and with `echo` the prompt's
    tokens get the same k."""
    prompt = request.prompt_logprobs
    if isinstance(request, p.ChatCompletionRequest):
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_LOGPROBS:
            raise RequestError("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {request.top_logprobs}")
        return (request.top_logprobs or 0) if request.logprobs else None, prompt
    assert isinstance(request, p.CompletionRequest)
    if request.echo and request.logprobs is not None:
        prompt = max(prompt or 0, request.logprobs)
    return request.logprobs, prompt


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
