"""The served models and what every route does with them: find the engine a request names, tokenize in the engine,
start the engine requests of a generation, and count each HTTP request in `strata_requests_total`.

Errors a client can fix raise `OpenAIError` naming the field (errors.py); each is counted once, under the model's
first served name.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from server import tracing
from server.engine.api import (
    Engine,
    EngineOverloaded,
    EngineUnavailable,
    RequestError,
    StructuredOutput,
    validate_cache_salt,
)
from server.logs import REQUEST_ID
from server.openai.errors import OpenAIError, internal_error, overloaded, unavailable, unknown_model
from server.openai.fields import refused_field
from server.openai.generation import Generation, WaitForDisconnect
from server.openai.limits import RequestLimits, check_request
from server.openai.metrics import FrontendMetrics
from server.openai.sampling import SamplingFields, sampling_params

logger = logging.getLogger(__name__)
# OpenTelemetry GenAI's gen_ai.operation.name of each endpoint (a Responses request runs as chat)
_OPERATIONS = {"chat": "chat", "completions": "text_completion"}
MAX_TOKEN_ID = 2**32  # tokenizers hold ids as u32

Prompts = Callable[[], list[list[int]]]  # tokenizes a request's prompts (in a worker thread)


class ServedModels:
    """The models the frontend serves (served name -> engine) and the metrics every route counts in.

    `models` is a live view: the server adds and removes models as the repository changes."""

    def __init__(self, models: Mapping[str, Engine], metrics: FrontendMetrics) -> None:
        self.models = models
        self.metrics = metrics

    def label(self, model: str) -> str:
        """The name `model`'s series carry: its engine's first served name (served_model_name's first, as
        vLLM's metrics), whichever of its names the request used."""
        engine = self.models.get(model)
        if engine is None:
            return model
        return next((name for name, served in self.models.items() if served is engine), model)

    def count(self, model: str, status: str) -> None:
        self.metrics.requests.labels(self.label(model), status).inc()

    def count_invalid(self, model: str) -> None:
        """Count a request refused before it reached serving (malformed JSON, schema errors, limits)."""
        self.metrics.requests.labels(model if model in self.models else "", "invalid").inc()

    def check_limits(self, request: SamplingFields, limits: RequestLimits) -> None:
        """`check_request`, counting a refused request."""
        try:
            check_request(request, limits, self.models.get(request.model))
        except OpenAIError:
            self.count_invalid(request.model)
            raise

    def engine_for(self, request: SamplingFields) -> Engine:
        """The engine a generation request names: 404 for an unknown model, 400 for a field it may not send."""
        engine = self.models.get(request.model)
        if engine is None:
            self.count_invalid(request.model)
            raise unknown_model(request.model)
        refused = refused_field(request.model_extra, request.ENDPOINT)
        if refused is not None:
            self.refuse(request.model, refused[1], refused[0])
        return engine

    def refuse(self, model: str, message: str, param: str | None) -> NoReturn:
        """A 400 naming `param`, counted as invalid."""
        self.count(model, "invalid")
        raise OpenAIError(400, message, param=param)

    def refuse_field(self, request: SamplingFields, exc: RequestError) -> NoReturn:
        param = request.param_name(exc.field)
        self.refuse(request.model, f"{param}: {exc.message}", param)

    def tokenize(self, model: str, param: str, tokenize: Callable[[Any], list[int]], value: Any) -> list[int]:
        """`tokenize(value)` (the engine's encode or chat template); its errors as the API's, naming `param`."""
        try:
            return tokenize(value)
        except RequestError as exc:
            self.refuse(model, f"{param}: {exc.message}", param)
        except EngineUnavailable as exc:
            self.count(model, "error")
            raise unavailable(model, exc) from None
        except Exception:
            logger.exception("tokenizing %s failed", param)
            self.count(model, "error")
            raise internal_error() from None

    def decode(self, model: str, engine: Engine, token_ids: list[int], param: str = "prompt") -> str:
        """The text of `token_ids` (an echoed prompt, /detokenize); ids no tokenizer can hold are the client's
        error, naming `param` (ids past the vocabulary are refused by the engine at submit)."""
        if not all(0 <= t < MAX_TOKEN_ID for t in token_ids):
            self.refuse(model, f"{param}: token ids must be integers in [0, {MAX_TOKEN_ID})", param)
        try:
            return engine.decode(token_ids)
        except Exception:
            logger.exception("decoding a prompt for echo failed")
            self.count(model, "error")
            raise internal_error() from None

    async def start(
        self,
        request: SamplingFields,
        engine: Engine,
        prompts: Prompts,
        client_gone: WaitForDisconnect,
        tool_grammar: StructuredOutput | None = None,
    ) -> Generation:
        """Tokenize, validate and submit n engine requests per prompt (`{request_id}-{i}`) in one worker-thread
        hop: tokenizing and an engine's submit (a worker round trip) may block, the event loop must not. Errors
        come before the first byte, so a bad streaming request still gets its 4xx status.

        The generation's id is the HTTP request's (observe.py); while tracing, its GenAI span is a child of the
        request's server span and the parent of every engine request's spans."""
        generation = Generation(
            engine,
            self.metrics,
            self.label(request.model),
            client_gone,
            REQUEST_ID.get() or uuid.uuid4().hex,
            self._span(request),
        )
        try:
            await asyncio.to_thread(self._submit, request, engine, prompts, generation, tool_grammar)
        except BaseException:
            generation.close()
            raise
        return generation

    @staticmethod
    def _span(request: SamplingFields) -> Any:
        """The GenAI span of a traced request ("chat smollm2"), None when not traced."""
        operation = _OPERATIONS.get(request.ENDPOINT, request.ENDPOINT)
        return tracing.start_span(
            f"{operation} {request.model}",
            tracing.current_traceparent(),
            {
                "gen_ai.operation.name": operation,
                "gen_ai.system": "strata",
                "gen_ai.request.model": request.model,
                "strata.request.stream": bool(getattr(request, "stream", False)),
                "strata.request.priority": request.priority,
            },
        )

    def _submit(
        self,
        request: SamplingFields,
        engine: Engine,
        prompts: Prompts,
        generation: Generation,
        tool_grammar: StructuredOutput | None,
    ) -> None:
        try:
            validate_cache_salt(request.cache_salt)
        except RequestError as exc:
            self.refuse_field(request, exc)
        jobs = []
        for ids in prompts():
            if not ids:
                self.refuse(request.model, "the prompt is empty", request.PROMPT_FIELD)
            try:
                jobs.extend(
                    (ids, sampling) for sampling in sampling_params(request, engine, ids, tool_grammar)
                )
            except RequestError as exc:
                self.refuse_field(request, exc)
        try:
            generation.submit(jobs, request.cache_salt, request.priority)
        except RequestError as exc:
            self.refuse_field(request, exc)
        except EngineOverloaded as exc:
            self.count(request.model, "rejected")
            raise overloaded(request.model, exc) from None
        except EngineUnavailable as exc:
            self.count(request.model, "error")
            raise unavailable(request.model, exc) from None
        except Exception:
            self.count(request.model, "error")
            raise
