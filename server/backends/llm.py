"""LLM models (`backend: "strata_llm"`): Strata's engine, bound into Triton through PyTriton as a decoupled model.

Inputs and outputs follow Triton's vLLM backend, so clients written for it work unchanged:

    inputs   text_input (BYTES), stream (BOOL), sampling_parameters (BYTES, JSON), exclude_input_in_output (BOOL),
             return_finish_reason, return_num_input_tokens, return_num_output_tokens, return_num_cached_tokens (BOOL)
    outputs  text_output (BYTES), finish_reason (BYTES), num_input_tokens, num_output_tokens,
             num_cached_tokens (UINT32: prompt tokens whose KV came from cache instead of prefill)

Sampling fields may also come as request parameters (`"parameters": {...}` of the generate endpoint). One engine
serves the model's latest chosen version; the same engine object backs the OpenAI frontend (`engines`).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry
from pytriton.model_config import ModelConfig, Tensor
from pytriton.proxy.types import Request

from kvbm.agent import build_connector
from kvbm.block_hash import BlockHash
from kvbm.client import KVIndexClient
from kvbm.config import KVBMConfig
from kvbm.connector import KVBMConnector
from kvbm.index import KVIndex
from kvbm.metrics import KVBMMetrics
from server.backends.staging import remove
from server.engine import EngineConfig, GenerationRequest, LLMEngine, RequestError, RequestId, SamplingParams
from server.engine.api import Engine, EngineUnavailable
from server.engine.stream import aiterate_outputs
from server.repository.scan import ModelSource
from server.router.config import RouterConfig
from server.router.metrics import RouterMetrics
from server.router.routed import RoutedEngine
from server.router.router import Router
from server.triton import TritonServer
from server.workers.discovery import Discovery
from server.workers.protocol import WorkerId
from server.workers.registry import Directory, WorkerRecord
from server.workers.remote import RemoteEngine, spawn_workers
from server.workers.worker import WorkerSpec, build_llm_engine

log = logging.getLogger(__name__)

_FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
          "return_num_output_tokens", "return_num_cached_tokens")
_NOT_SAMPLING = set(_FLAGS) | {"text_input", "sampling_parameters"}
INPUTS = [Tensor(name="text_input", dtype=bytes, shape=(1,))] + [
    Tensor(name=name, dtype=np.bool_, shape=(1,), optional=True) for name in _FLAGS
] + [Tensor(name="sampling_parameters", dtype=bytes, shape=(1,), optional=True)]
OUTPUTS = [
    Tensor(name="text_output", dtype=bytes, shape=(-1,)),
    Tensor(name="finish_reason", dtype=bytes, shape=(-1,)),
    Tensor(name="num_input_tokens", dtype=np.uint32, shape=(-1,)),
    Tensor(name="num_output_tokens", dtype=np.uint32, shape=(-1,)),
    Tensor(name="num_cached_tokens", dtype=np.uint32, shape=(-1,)),
]

@dataclass(slots=True)
class LLMServing:
    """How `strata serve` deploys LLM models (from its flags).

    workers     engine processes per model; None: the model's instance_group count, else one in-process engine;
                0 with remote_workers: none here, the model is served by the remote workers that join
    kvbm        tiers below each engine's pool (None: G1-only prefix caching)
    kvbm_service  address of a standalone `strata kvbm` (multi-node): workers publish to Redis, the router queries it
    overrides   EngineConfig fields set for every model (--context-length, --max-concurrent-requests, ...)
    remote_workers  Redis URL where `strata worker` processes register (--accept-remote-workers); None: local only
    """

    router: RouterConfig = field(default_factory=RouterConfig)
    workers: int | None = None
    kvbm: KVBMConfig | None = None
    kvbm_service: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    remote_workers: str | None = None


class LLMBackend:
    """Builds an engine per LLM model and binds it into Triton; `engines` is shared with the OpenAI frontend.

    One worker runs the engine in this process; N workers run in child processes behind a `RoutedEngine` whose
    router reads the embedded KV index (fed by the workers' forwarded block events) or the KVBM service. With
    remote workers accepted, every model is routed (N child processes, N >= 0) and a `Discovery` thread adds
    the `strata worker` processes that register for it in Redis.
    """

    def __init__(self, triton: TritonServer, serving: LLMServing, registry: CollectorRegistry | None = None) -> None:
        self.triton = triton
        self.serving = serving
        self.engines: dict[str, Engine] = {}
        self._kvbm_metrics = KVBMMetrics(registry)  # tiers of an in-process engine; index size and event lag
        self.index = KVIndex(metrics=self._kvbm_metrics)
        self._router_metrics = RouterMetrics.create(registry)
        self._connectors: dict[str, KVBMConnector] = {}
        self._discoveries: dict[str, Discovery] = {}

    def load(self, model: ModelSource) -> None:
        version = model.versions[-1]
        config = EngineConfig.from_json(model.path / str(version) / model.model_filename)
        config.model_name = model.name
        for key, value in self.serving.overrides.items():
            setattr(config, key, value)
        config.validate(f"{model.name} (model.json with command-line overrides)")
        if model.name in self.engines:
            self.unload(model.name)
        workers = self.serving.workers
        if workers is None:
            workers = model.config.instance_group[0].count if model.config.instance_group else 1
        if self.serving.remote_workers is None:
            workers = max(workers, 1)  # 0 (remote workers only) needs --accept-remote-workers
        engine = self._build(model.name, config, workers)
        remove(self.triton.store / model.name)  # the placeholder that listed the model until now
        self.triton.pytriton.bind(
            model_name=model.name, infer_func=_infer_function(engine), inputs=INPUTS, outputs=OUTPUTS,
            model_version=version, config=ModelConfig(batching=False, decoupled=True),
        )
        self.engines[model.name] = engine
        log.info("%s: serving version %d on %d worker(s) (%s, %s)", model.name, version, workers, config.model,
                 config.dtype)

    def _build(self, name: str, config: EngineConfig, workers: int) -> Engine:
        kvbm = self.serving.kvbm
        if workers == 1 and self.serving.remote_workers is None:
            connector = None
            if kvbm is not None:
                connector = build_connector(kvbm, f"{name}-0", index=self.index, metrics=self._kvbm_metrics)
                self._connectors[name] = connector
            return LLMEngine(config, connector)
        standalone = self.serving.kvbm_service is not None
        spec = WorkerSpec(build_llm_engine, (config, kvbm), forward_events=not standalone)
        remotes = spawn_workers([WorkerId(f"{name}-w{i}") for i in range(workers)], spec,
                                event_sink=None if standalone else self.index) if workers else []
        lookup = KVIndexClient(self.serving.kvbm_service) if standalone else self.index
        router = Router(self.serving.router, lookup, self._router_metrics)
        if remotes:
            routed = RoutedEngine(remotes, router, remotes[0].info.block_size, BlockHash(remotes[0].info.salt))
        else:  # remote workers only (--workers 0): the layout comes with the first that joins
            routed = RoutedEngine([], router, None, None, model_name=name, max_model_len=config.max_model_len)
        if self.serving.remote_workers is not None:
            self._discoveries[name] = self._discover(name, routed, event_sink=None if standalone else self.index)
        return routed

    def _discover(self, name: str, routed: RoutedEngine, event_sink: KVIndex | None) -> Discovery:
        """Follow `name`'s registrations in Redis; remote workers' forwarded block events go to `event_sink`."""

        def connect(record: WorkerRecord, server_id: str) -> RemoteEngine:
            return RemoteEngine.connect(WorkerId(record.worker_id), record.address, server_id,
                                        event_sink=event_sink)

        return Discovery(Directory(self.serving.remote_workers, name), routed, connect).start()

    def unload(self, name: str) -> None:
        discovery = self._discoveries.pop(name, None)
        if discovery is not None:
            discovery.stop()
        engine = self.engines.pop(name, None)
        self.triton.unbind(name)
        _close(engine)
        connector = self._connectors.pop(name, None)
        if connector is not None:
            connector.close()

    def stop(self) -> None:
        for discovery in self._discoveries.values():
            discovery.stop()
        self._discoveries.clear()
        for name in list(self.engines):
            _close(self.engines.pop(name))
        for connector in self._connectors.values():
            connector.close()
        self._connectors.clear()


def _close(engine: Engine | None) -> None:
    if isinstance(engine, LLMEngine):
        engine.shutdown()
    elif isinstance(engine, RoutedEngine):
        engine.close()


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


def _infer_function(engine: Engine) -> Callable[[list[Request]], AsyncIterator[list[dict[str, np.ndarray]]]]:
    async def infer(requests: list[Request]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        if len(requests) != 1:  # batching is off, so Triton hands over one request per call
            raise TritonClientError(f"expected one request per call, got {len(requests)}")
        try:
            async for response in _generate(engine, requests[0]):
                yield [response]
        except RequestError as exc:
            raise TritonClientError(str(exc)) from None
        except EngineUnavailable as exc:
            raise TritonClientError(f"{engine.model_name} cannot take requests now: {exc}") from None
        except Exception:
            log.exception("%s: generation failed", engine.model_name)
            raise TritonClientError("internal error while generating; see the server log") from None

    return infer


async def _generate(engine: Engine, request: Request) -> AsyncIterator[dict[str, np.ndarray]]:
    prompt, flags, sampling = _parse(request, engine)
    prompt_ids = engine.encode(prompt)
    generation = GenerationRequest(RequestId(f"triton-{uuid.uuid4().hex}"), prompt_ids, sampling)
    stream = flags["stream"]
    pieces: list[str] = [] if flags["exclude_input_in_output"] or stream else [prompt]
    async for output in aiterate_outputs(engine, generation):
        if output.finish_reason == "error":
            log.error("%s: generation failed: %s", engine.model_name, output.error)
            raise TritonClientError("internal error while generating; see the server log")
        if stream:
            if output.new_text or output.finished:
                yield _response(output.new_text, output, flags)
        else:
            pieces.append(output.new_text)
            if output.finished:
                yield _response("".join(pieces), output, flags)


def _parse(request: Request, engine: Engine) -> tuple[str, dict[str, bool], SamplingParams]:
    """text, flags and validated sampling parameters; raises RequestError naming the field."""
    text = _scalar(request, "text_input")
    if text is None:
        raise RequestError("text_input", "required")
    prompt = text.decode("utf-8") if isinstance(text, bytes) else str(text)
    flags = {name: bool(_scalar(request, name) or False) for name in _FLAGS}
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
        if key in _FLAGS:
            flags[key] = bool(value)
        elif key not in _NOT_SAMPLING:
            raw.setdefault(key, value)
    for key in ("max_tokens", "top_k", "seed", "min_tokens"):  # request parameters arrive as strings or floats
        if isinstance(raw.get(key), float) and raw[key].is_integer():
            raw[key] = int(raw[key])
    return prompt, flags, SamplingParams.from_dict(raw, engine.max_model_len)


def _scalar(request: Request, name: str) -> Any:
    array = request.data.get(name)
    if array is None or array.size == 0:
        return None
    return array.reshape(-1)[0]


def _response(text: str, output, flags: dict[str, bool]) -> dict[str, np.ndarray]:
    return {
        "text_output": np.array([text.encode("utf-8")], dtype=object),
        "finish_reason": np.array([(output.finish_reason or "").encode()], dtype=object),
        "num_input_tokens": np.array([output.num_prompt_tokens], dtype=np.uint32),
        "num_output_tokens": np.array([output.num_output_tokens], dtype=np.uint32),
        "num_cached_tokens": np.array([output.num_cached_tokens], dtype=np.uint32),
    }
