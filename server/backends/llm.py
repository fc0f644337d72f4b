"""LLM models (`backend: "strata_llm"`): an engine bound into Triton through PyTriton as a decoupled model.

Inputs and outputs are those of Triton's vLLM backend (src/model.py, src/utils/request.py), so clients written for
it work unchanged:

    inputs   text_input (BYTES), stream (BOOL), sampling_parameters (BYTES, JSON), exclude_input_in_output (BOOL),
             return_finish_reason, return_num_input_tokens, return_num_output_tokens, return_num_cached_tokens,
             return_cumulative_logprob, return_logprobs (BOOL)
    outputs  text_output (BYTES), and only when asked for with its return_* input:
             finish_reason (BYTES: "stop", "length", "abort"; "None" on a streamed response before the last),
             num_input_tokens (UINT32: prompt tokens), num_output_tokens (UINT32: tokens of this response's text),
             num_cached_tokens (UINT32, Strata's own: prompt tokens whose KV came from cache instead of prefill),
             cumulative_logprob (FP32: the sum of the logprobs of every token generated so far, vLLM's),
             logprobs (BYTES, Strata's: JSON, one object per token of this response: token_id, logprob,
             decoded_token, top_logprobs [{token_id, logprob, decoded_token}], as many as sampling_parameters'
             `logprobs`, 0 by default)

`text_output` starts with the prompt unless `exclude_input_in_output` is true; a stream never repeats the prompt,
so `exclude_input_in_output` false with `stream` true is a 400. Sampling fields may also come as request parameters
(`"parameters": {...}` of the generate endpoint), as may the flags. `cache_salt` (vLLM's field: the prompt shares
cached KV blocks only with requests of the same salt) and `priority` (vLLM's: lower runs first, under the engine's
`--scheduling-policy priority`) are taken from either place, like a sampling field.

`LLMBackend` is the repository's backend for these models: loading binds the engine `LLMDeployment` builds for the
model's latest chosen version; unloading unbinds it and stops the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from pytriton.model_config import ModelConfig, Tensor
from pytriton.proxy.types import Request
from tritonclient.utils import InferenceServerException

from server.backends.staging import remove
from server.backends.unavailable import stage_reason
from server.deployment import LLMDeployment
from server.engine.api import (
    Engine,
    EngineOverloaded,
    EngineUnavailable,
    GenerationOutput,
    GenerationRequest,
    RequestError,
    RequestId,
    SamplingParams,
    TokenLogprobs,
    check_prompt_chars,
    max_output_tokens,
    validate_cache_salt,
)
from server.engine.stream import aiterate_outputs
from server.repository.backend import LoadError
from server.repository.scan import ModelSource
from server.triton import TritonServer

log = logging.getLogger(__name__)

_OPTIONAL_OUTPUTS = (
    "finish_reason", "num_input_tokens", "num_output_tokens", "num_cached_tokens", "cumulative_logprob", "logprobs",
)  # fmt: skip
_LOGPROB_OUTPUTS = {"cumulative_logprob", "logprobs"}
_FLAGS = ("stream", "exclude_input_in_output", *(f"return_{name}" for name in _OPTIONAL_OUTPUTS))
_NOT_SAMPLING = set(_FLAGS) | {"text_input", "sampling_parameters"}
INPUTS = (
    [Tensor(name="text_input", dtype=bytes, shape=(1,))]
    + [Tensor(name=name, dtype=np.bool_, shape=(1,), optional=True) for name in _FLAGS]
    + [Tensor(name="sampling_parameters", dtype=bytes, shape=(1,), optional=True)]
)
OUTPUTS = [  # shapes as the vLLM backend declares them
    Tensor(name="text_output", dtype=bytes, shape=(-1,)),
    Tensor(name="finish_reason", dtype=bytes, shape=(-1,)),
    Tensor(name="num_input_tokens", dtype=np.uint32, shape=(1,)),
    Tensor(name="num_output_tokens", dtype=np.uint32, shape=(-1,)),
    Tensor(name="num_cached_tokens", dtype=np.uint32, shape=(1,)),
    Tensor(name="cumulative_logprob", dtype=np.float32, shape=(1,)),
    Tensor(name="logprobs", dtype=bytes, shape=(1,)),
]


class LLMBackend:
    """Binds each LLM model's engine into Triton (see server.repository.backend.ModelBackend)."""

    def __init__(self, triton: TritonServer, deployment: LLMDeployment) -> None:
        self.triton = triton
        self.deployment = deployment

    def stage(self, model: ModelSource) -> None:
        """List the model until Strata binds its engine (PyTriton then owns the folder)."""
        if model.name not in self.deployment.engines:
            reason = (
                f"{model.name} is an LLM model: Strata starts its engine (--load-model {model.name}, or the "
                "none/poll control modes); Triton's load_model can only reload an engine Strata already started"
            )
            stage_reason(model.name, reason, self.triton.store)

    def load(self, model: ModelSource) -> None:
        """Start the model's engine and bind it, replacing the running one."""
        try:
            plan = self.deployment.plan(
                model
            )  # a model.json that does not validate leaves the running engine
        except Exception as exc:
            raise self._unavailable(model.name, exc) from exc
        if model.name in self.deployment.engines:
            self.unload(model.name)
        try:
            engine = self.deployment.start(plan)
            remove(self.triton.store / model.name)  # the placeholder that listed the model until now
            bind_engine(self.triton, model.name, plan.version, engine)
        except Exception as exc:  # weights, a worker that does not start, a failed bind: this model only
            self.unload(model.name)
            raise self._unavailable(model.name, exc) from exc
        log.info(
            "%s: serving version %d on %d worker(s) (%s)",
            model.name,
            plan.version,
            plan.workers,
            plan.summary,
        )

    def unload(self, name: str) -> None:
        self.triton.unbind(name)  # also takes its folder (or the placeholder) out of the store
        self.deployment.stop(name)

    def _unavailable(self, name: str, exc: Exception) -> LoadError:
        """The load error for `exc`; a model left without an engine is listed with it as the reason."""
        reason = f"engine failed to start: {exc}"
        if name not in self.deployment.engines:
            stage_reason(name, reason, self.triton.store)
            try:
                self.triton.load(name)
            except InferenceServerException:
                pass  # fails by design: Triton now lists the model UNAVAILABLE with the reason
        return LoadError(reason)


class TritonClientError(Exception):
    """An error sent to the Triton client as its message alone.

    PyTriton formats errors with `traceback.format_exception`; with no traceback and a builtins-like module the
    client reads "TritonClientError: temperature: must be in [0.0, inf], got -1" instead of a stack dump.
    """

    __module__ = "builtins"

    @property
    def __traceback__(self):
        return None

    @__traceback__.setter
    def __traceback__(self, _value) -> None:
        pass


@dataclass(slots=True)
class TritonRequest:
    """One request in the vLLM backend's terms."""

    prompt: str
    stream: bool  # one response per new piece of text, else one response at the end
    prepend_input: bool  # text_output starts with the prompt (never when streaming)
    outputs: tuple[str, ...]  # the optional outputs asked for (return_<output> true)
    sampling: dict[str, Any]  # the client's sampling fields, validated once the prompt's length is known
    cache_salt: str | None  # vLLM's field, checked here; None shares blocks with every unsalted request
    priority: int  # vLLM's field: lower runs first under --scheduling-policy priority (0 otherwise)


class TritonUnavailableError(TritonClientError):
    """The engine cannot take the request now (its wait queue is full, or no worker is up): sent with Triton's code
    UNAVAILABLE (server.pytriton_patches keys it on this class name), as tritonserver's own full queue is. A gRPC
    stream opened with the `triton_grpc_error: true` header ends with status UNAVAILABLE; without it a stream
    carries only the message, "TritonUnavailableError: ... retry later". Triton 2.51's generate endpoints answer
    400 to any error a model sends in a response, whatever its code (GenerateRequestClass::InferResponseComplete
    reads the code of the error after freeing it), so over HTTP the class name is how a client tells "retry
    later" from a bad request."""

    __module__ = "builtins"


def bind_engine(triton: TritonServer, name: str, version: int, engine: Engine) -> None:
    """Serve `engine` as Triton model `name` (decoupled, with the vLLM backend's tensors)."""
    triton.pytriton.bind(
        model_name=name,
        infer_func=_infer_function(engine),
        inputs=INPUTS,
        outputs=OUTPUTS,
        model_version=version,
        config=ModelConfig(batching=False, decoupled=True),
    )


def _infer_function(engine: Engine) -> Callable[[list[Request]], AsyncIterator[list[dict[str, np.ndarray]]]]:
    async def infer(requests: list[Request]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        if len(requests) != 1:  # batching is off, so Triton hands over one request per call
            raise TritonClientError(f"expected one request per call, got {len(requests)}")
        try:
            async for response in _generate(engine, requests[0]):
                yield [response]
        except RequestError as exc:
            raise TritonClientError(str(exc)) from None
        except EngineOverloaded as exc:
            raise TritonUnavailableError(str(exc)) from None
        except EngineUnavailable as exc:
            raise TritonUnavailableError(f"{engine.model_name} cannot take requests now: {exc}") from None
        except Exception:
            log.exception("%s: generation failed", engine.model_name)
            raise TritonClientError("internal error while generating; see the server log") from None

    return infer


async def _generate(engine: Engine, request: Request) -> AsyncIterator[dict[str, np.ndarray]]:
    asked = _parse(request)
    check_prompt_chars("text_input", len(asked.prompt), engine.max_model_len)  # before the tokenizer's work
    prompt_ids = await asyncio.to_thread(
        engine.encode, asked.prompt
    )  # never on the event loop (a worker call)
    if _LOGPROB_OUTPUTS.intersection(asked.outputs) and asked.sampling.get("logprobs") is None:
        asked.sampling["logprobs"] = 0  # the chosen tokens' logprobs, no alternatives
    sampling = SamplingParams.from_dict(asked.sampling, max_output_tokens(engine, len(prompt_ids)))
    generation = GenerationRequest(
        RequestId(f"triton-{uuid.uuid4().hex}"),
        prompt_ids,
        sampling,
        asked.cache_salt,
        priority=asked.priority,
    )
    pieces: list[str] = [asked.prompt] if asked.prepend_input else []
    reported_tokens = 0  # output tokens counted in responses sent so far
    logprobs = _Logprobs()
    async for output in aiterate_outputs(engine, generation):
        if output.finish_reason == "error":
            log.error("%s: generation failed: %s", engine.model_name, output.error)
            if output.retryable:  # no worker could resume it (its ranks failed): the client may retry
                raise TritonUnavailableError(f"{engine.model_name} could not finish the request now; retry")
            raise TritonClientError("internal error while generating; see the server log")
        logprobs.add(output.logprobs)
        if asked.stream:
            if output.new_text or output.finished:
                yield _response(
                    output.new_text,
                    output,
                    output.num_output_tokens - reported_tokens,
                    asked.outputs,
                    logprobs,
                )
                reported_tokens = output.num_output_tokens
        else:
            pieces.append(output.new_text)
            if output.finished:
                yield _response("".join(pieces), output, output.num_output_tokens, asked.outputs, logprobs)


class _Logprobs:
    """The logprobs of a request's tokens not yet sent in a response, and their running sum."""

    def __init__(self) -> None:
        self.pending: list[TokenLogprobs] = []
        self.cumulative = 0.0

    def add(self, entries: list[TokenLogprobs] | None) -> None:
        for entry in entries or ():
            self.pending.append(entry)
            self.cumulative += entry.logprob

    def take_json(self) -> bytes:
        entries, self.pending = self.pending, []
        return json.dumps(
            [
                {
                    "token_id": e.token_id,
                    "logprob": e.logprob,
                    "decoded_token": e.token,
                    "top_logprobs": [
                        {"token_id": t, "logprob": v, "decoded_token": text}
                        for t, v, text in zip(e.top_token_ids, e.top_logprobs, e.top_tokens, strict=True)
                    ],
                }
                for e in entries
            ]
        ).encode()


def _parse(request: Request) -> TritonRequest:
    """The request's prompt, flags and sampling fields; raises RequestError naming the field."""
    text = _scalar(request, "text_input")
    if text is None:
        raise RequestError("text_input", "required")
    try:
        prompt = text.decode("utf-8") if isinstance(text, bytes) else str(text)
    except UnicodeDecodeError as exc:
        raise RequestError("text_input", f"not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    flags = _flags(request)
    stream = bool(flags.get("stream"))
    exclude_input = flags.get("exclude_input_in_output")
    prepend_input = not stream if exclude_input is None else not exclude_input
    if stream and prepend_input:
        raise RequestError(
            "exclude_input_in_output",
            "must be true when streaming (a stream never repeats the prompt); leave it out or set it to true",
        )
    outputs = tuple(name for name in _OPTIONAL_OUTPUTS if flags.get(f"return_{name}"))
    sampling = _sampling_fields(request)
    cache_salt = sampling.pop("cache_salt", None)
    validate_cache_salt(cache_salt)
    priority = sampling.pop("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestError("priority", f"must be an integer, got {priority!r}")
    return TritonRequest(prompt, stream, prepend_input, outputs, sampling, cache_salt, priority)


def _flags(request: Request) -> dict[str, bool]:
    """The boolean inputs the request gives, as tensors or as request parameters (those win); absent ones left out."""
    flags = {name: bool(value) for name in _FLAGS if (value := _scalar(request, name)) is not None}
    for key, value in (request.parameters or {}).items():
        if key in _FLAGS:
            flags[key] = bool(value)
    return flags


def _sampling_fields(request: Request) -> dict[str, Any]:
    """Sampling fields from `sampling_parameters` (JSON) and the request parameters (validated by the caller)."""
    raw: dict[str, Any] = {}
    encoded = _scalar(request, "sampling_parameters")
    if encoded:
        try:
            raw = json.loads(encoded)
        except json.JSONDecodeError as exc:
            raise RequestError("sampling_parameters", f"not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise RequestError("sampling_parameters", "must be a JSON object")
    for key, value in (request.parameters or {}).items():
        if key not in _NOT_SAMPLING:
            raw.setdefault(key, value)
    for key in (
        "max_tokens",
        "top_k",
        "seed",
        "min_tokens",
    ):  # request parameters arrive as strings or floats
        if isinstance(raw.get(key), float) and raw[key].is_integer():
            raw[key] = int(raw[key])
    return raw


def _scalar(request: Request, name: str) -> Any:
    array = request.data.get(name)
    if array is None or array.size == 0:
        return None
    return array.reshape(-1)[0]


def _response(
    text: str, output: GenerationOutput, num_output_tokens: int, outputs: tuple[str, ...], logprobs: _Logprobs
) -> dict[str, np.ndarray]:
    """One response: text_output, and the optional outputs asked for. `num_output_tokens`: this response's own;
    `logprobs`: the request's, of which this response takes the tokens not yet sent."""
    optional = {
        "finish_reason": lambda: np.array([str(output.finish_reason).encode()], dtype=object),
        "num_input_tokens": lambda: np.array([output.num_prompt_tokens], dtype=np.uint32),
        "num_output_tokens": lambda: np.array([num_output_tokens], dtype=np.uint32),
        "num_cached_tokens": lambda: np.array([output.num_cached_tokens], dtype=np.uint32),
        "cumulative_logprob": lambda: np.array([logprobs.cumulative], dtype=np.float32),
        "logprobs": lambda: np.array([logprobs.take_json()], dtype=object),
    }
    return {"text_output": np.array([text.encode("utf-8")], dtype=object)} | {
        name: optional[name]() for name in outputs
    }
