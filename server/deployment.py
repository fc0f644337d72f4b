"""How `strata serve` runs each LLM model: the engine, workers, router, KVBM tiers and discovery behind one `Engine`.

`LLMServing` is what the flags decide for every model; `LLMDeployment.plan` adds what one model's repository entry
decides (model.json, instance_group) and `start` builds it:

    one worker, no remote workers   LLMEngine in this process, with its KVBM connector (tiers below its pool)
    N workers                       N worker processes behind a RoutedEngine; the router reads the embedded KV index
                                    (fed by the workers' forwarded block events) or the `strata kvbm` service
    P prefill + D decode workers    disaggregated: the same, with a second router over the prefill workers and the
                                    conditional rule (server/router/disagg.py); from --prefill-workers and
                                    --decode-workers, or config.pbtxt parameters `prefill_workers`/`decode_workers`
    backend "vllm"                  N worker processes under --vllm-python, each running vLLM (server/vllm_engine),
                                    behind the same RoutedEngine; their vLLM KV events feed the same index (N = 0
                                    with remote workers: `strata worker --vllm-python` on other hosts); prefill and
                                    decode roles too, their KV handed over through the KVBM tiers
    remote workers accepted         every model routed (N >= 0 processes here) and a Discovery thread adding the
                                    `strata worker` processes that register for the model in Redis

`engines` holds the running engines by model name; the Triton binding (server.backends.llm) and the OpenAI frontend
both serve from it.

Stopping a model closes its engines, here or in their worker processes; an engine closes its KVBM connector,
which copies its G2 blocks to its G3, and the last process mapping the node's G2 segment removes it
(kvbm/connector.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from kvbm.agent import build_connector
from kvbm.block_hash import BlockHash
from kvbm.client import KVIndexClient
from kvbm.config import KVBMConfig
from kvbm.index import KVIndex
from kvbm.metrics import KVBMMetrics
from kvbm.transfer import KVTransferConfig
from kvbm.wire import service_keys
from server.engine.api import Engine
from server.engine.config import EngineConfig, served_names
from server.engine.llm_engine import LLMEngine
from server.errors import ConfigError
from server.logs import LogSettings
from server.pool_metrics import PoolCollector
from server.repository.model_config import VLLM
from server.repository.scan import ModelSource
from server.router.config import RouterConfig
from server.router.disagg import DisaggConfig, DisaggRule
from server.router.metrics import RouterMetrics
from server.router.routed import RoutedEngine
from server.router.router import Router
from server.tracing import TracingSettings
from server.vllm_engine.config import CPU_BIND_ENV, VLLMConfig, cpu_binds
from server.workers.discovery import Discovery
from server.workers.external import WORKER_CPUS_ENV, ExternalSpec
from server.workers.protocol import WorkerId
from server.workers.registry import Directory, WorkerRecord
from server.workers.remote import RemoteEngine, spawn_workers
from server.workers.transport import link_keys
from server.workers.worker import WorkerSpec, build_llm_engine, warm_chat_template

log = logging.getLogger(__name__)


def _share_cores(config: EngineConfig, workers: int) -> None:
    """Without `num_threads` in model.json, a model's local engine processes (each worker's ranks when sharded)
    split this host's cores between them (at least one thread each) instead of each taking all of them: OpenMP
    teams that together outnumber the cores preempt each other at every barrier (docs/llm.md, "CPU threads").
    One process keeps every core."""
    processes = workers * config.world_size
    cores = len(os.sched_getaffinity(0))
    if config.num_threads is None and processes > 1:
        config.num_threads = max(1, cores // processes)
    elif config.num_threads is not None and config.num_threads * processes > cores:
        log.warning(
            "%s: %d engine processes x num_threads %d exceed this host's %d cores; their OpenMP threads will "
            "preempt each other (leave num_threads unset to split the cores)",
            config.model_name, processes, config.num_threads, cores,
        )  # fmt: skip


@dataclass(slots=True)
class LLMServing:
    """How `strata serve` deploys LLM models (from its flags).

    workers     engine processes per model; None: the model's instance_group count, else one in-process engine;
                0 with remote_workers: none here, the model is served by the remote workers that join
    kvbm        tiers below each engine's pool (None: G1-only prefix caching)
    kvbm_service  address of a standalone `strata kvbm` (multi-node): workers publish to Redis, the router queries it
    overrides   EngineConfig fields set for every model (--context-length, --max-concurrent-requests, ...)
    remote_workers  Redis URL where `strata worker` processes register (--accept-remote-workers); None: local only
    cluster_secret  authenticates the links to remote workers and to the KVBM service (required with either)
    prefill_workers, decode_workers  disaggregated serving for every LLM model (None: as each model's config.pbtxt
                parameters say, else aggregated); remote workers of either role may join such a model
    disagg      the conditional rule's thresholds (--max-local-prefill-length, --max-prefill-queue-size)
    """

    router: RouterConfig = field(default_factory=RouterConfig)
    workers: int | None = None
    kvbm: KVBMConfig | None = None
    kvbm_service: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    remote_workers: str | None = None
    cluster_secret: bytes | None = field(default=None, repr=False)
    prefill_workers: int | None = None
    decode_workers: int | None = None
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    vllm_python: str | None = None  # the interpreter of a venv with vLLM (--vllm-python), for backend vllm
    logs: LogSettings = field(default_factory=LogSettings)  # worker processes log as the server does
    tracing: TracingSettings = field(default_factory=TracingSettings)  # and trace to the same collector


@dataclass(slots=True)
class EnginePlan:
    """What one LLM model runs: its latest chosen version's model.json with the flags' overrides, on `workers`.
    `roles` (disaggregated serving): one per worker process, prefill workers first; None: aggregated."""

    name: str
    version: int
    config: EngineConfig | VLLMConfig
    workers: int  # engine processes; 1 without remote workers means in this process; 0: remote workers only
    roles: list[str] | None = None

    @property
    def served(self) -> tuple[str, ...]:
        """The OpenAI API's names of the model (served_model_name in model.json, else the model's folder)."""
        if isinstance(self.config, VLLMConfig):
            return served_names(self.config.engine_args.get("served_model_name"), self.name)
        return served_names(self.config.served_model_name, self.name)

    @property
    def summary(self) -> str:
        if isinstance(self.config, VLLMConfig):
            return f"vLLM, {self.config.engine_args['model']}"
        return f"{self.config.model}, {self.config.dtype}"


class LLMDeployment:
    """Builds, holds and stops the engine of each LLM model. `engines` (by model name) is what Triton, the planner
    and the pool metrics see; `served` (by each served name, a model's first name first) what the OpenAI API does."""

    def __init__(self, serving: LLMServing, registry: CollectorRegistry | None = None) -> None:
        self.serving = serving
        self.engines: dict[str, Engine] = {}
        self.served: dict[str, Engine] = {}
        self._names: dict[str, tuple[str, ...]] = {}  # model -> its served names
        self._kvbm_metrics = KVBMMetrics(registry)  # tiers of an in-process engine; index size and event lag
        self._index = KVIndex(metrics=self._kvbm_metrics)
        self._router_metrics = RouterMetrics.create(registry)
        if registry is not None:
            registry.register(PoolCollector(self.engines))
        self._discoveries: dict[str, Discovery] = {}

    def plan(self, model: ModelSource) -> EnginePlan:
        """Read and validate the model's engine settings; ValueError names model.json and the field."""
        plan = self._plan(model)
        try:
            plan.served  # noqa: B018 (validates served_model_name)
        except ValueError as exc:
            raise ConfigError(model.path / str(plan.version) / model.model_filename, str(exc)) from None
        return plan

    def _plan(self, model: ModelSource) -> EnginePlan:
        version = model.versions[-1]
        if model.backend == VLLM:
            return self._plan_vllm(model, version)
        config = EngineConfig.from_json(model.path / str(version) / model.model_filename)
        config.model_name = model.name
        for key, value in self.serving.overrides.items():
            setattr(config, key, value)
        config.validate(f"{model.name} (model.json with command-line overrides)")
        roles = self._roles(model)
        if roles is not None:
            _share_cores(config, len(roles))
            return EnginePlan(model.name, version, config, len(roles), roles)
        workers = self._workers(model)
        if self.serving.remote_workers is None:
            workers = max(workers, 1)  # 0 (remote workers only) needs --accept-remote-workers
        _share_cores(config, workers)
        return EnginePlan(model.name, version, config, workers)

    def _plan_vllm(self, model: ModelSource, version: int) -> EnginePlan:
        """A Triton vLLM-backend model: vLLM in worker processes of the vLLM venv (never in this process)."""
        pbtxt = model.path / "config.pbtxt"
        roles = self._roles(model)
        workers = len(roles) if roles is not None else self._workers(model)
        if self.serving.remote_workers is None:
            workers = max(workers, 1)
        if workers > 0 and self.serving.vllm_python is None:
            raise ConfigError(
                pbtxt,
                'backend "vllm" runs vLLM in worker processes of a vLLM venv: start strata serve with '
                "--vllm-python (or STRATA_VLLM_PYTHON); `make vllm` builds .venv-vllm",
            )
        if roles is not None and self.serving.kvbm is None:
            raise ConfigError(
                pbtxt,
                'disaggregated serving on backend "vllm" hands the prompt\'s KV over through the KVBM tiers '
                "(StrataKVConnector); drop --no-kvbm",
            )
        config = VLLMConfig.from_json(model.path / str(version) / model.model_filename)
        config.model_name = model.name
        config.apply_overrides(self.serving.overrides)
        ranks = config.parallel.world_size
        if roles is not None and ranks > 1:
            raise ConfigError(
                model.path / str(version) / model.model_filename,
                f'disaggregated serving on backend "vllm" hands KV over through StrataKVConnector, which holds '
                f"whole blocks, not the parts of vLLM's {ranks} ranks: serve this model aggregated, or unsharded",
            )
        if config.parallel.pipeline_parallel_size > 1 and config.engine_args.get("enforce_eager"):
            log.warning(
                "%s: vLLM 0.32's CPU build fails the first request with pipeline_parallel_size > 1 and "
                "enforce_eager true (it allocates a stage's intermediate tensors only while compiling)", model.name,
            )  # fmt: skip
        return EnginePlan(model.name, version, config, workers, roles)

    def _workers(self, model: ModelSource) -> int:
        """Engine processes for an aggregated model: --workers, else its instance_group count, else 1."""
        if self.serving.workers is not None:
            return self.serving.workers
        return model.config.instance_group[0].count if model.config.instance_group else 1

    def _roles(self, model: ModelSource) -> list[str] | None:
        """Disaggregated roles of the model's worker processes, prefill first (None: aggregated). The flags win
        over config.pbtxt `parameters` (Triton's instance_group cannot say roles)."""
        counts = [self.serving.prefill_workers, self.serving.decode_workers]
        if counts == [None, None]:
            params = model.config.parameters
            keys = ("prefill_workers", "decode_workers")
            if not any(key in params for key in keys):
                return None
            for i, key in enumerate(keys):
                value = params[key].string_value if key in params else "0"
                if not value.isdigit():
                    raise ConfigError(
                        model.path / "config.pbtxt",
                        f"parameters {key}: expected a count of workers, got {value!r}",
                    )
                counts[i] = int(value)
        prefill, decode = (count or 0 for count in counts)
        if decode == 0 and self.serving.remote_workers is None:
            raise ConfigError(
                model.path / "config.pbtxt",
                f"{model.name}: disaggregated serving needs at least one decode worker here "
                "(--decode-workers, or parameters decode_workers), or --accept-remote-workers",
            )
        return ["prefill"] * prefill + ["decode"] * decode

    def start(self, plan: EnginePlan) -> Engine:
        """Build the model's engine and add it to `engines` and its names to `served` (the running one's go
        first); ValueError for a served name another model has."""
        taken = {name: model for model, names in self._names.items() if model != plan.name for name in names}
        clash = next((name for name in plan.served if name in taken), None)
        if clash is not None:
            raise ValueError(f"{plan.name}: served_model_name {clash!r} is already {taken[clash]}'s")
        in_process = isinstance(plan.config, EngineConfig) and plan.roles is None
        if in_process and plan.workers == 1 and self.serving.remote_workers is None:
            engine = self._in_process(plan)
        else:
            engine = self._routed(plan)
        self.engines[plan.name] = engine
        for name in self._names.pop(plan.name, ()):
            self.served.pop(name, None)
        self._names[plan.name] = plan.served
        for name in plan.served:
            self.served[name] = engine
        return engine

    def stop(self, name: str) -> None:
        """Stop the model's discovery and engine."""
        discovery = self._discoveries.pop(name, None)
        if discovery is not None:
            discovery.stop()
        for served in self._names.pop(name, ()):
            self.served.pop(served, None)
        engine = self.engines.pop(name, None)
        if engine is not None:
            engine.close()  # an engine closes the KVBM connector it was given

    def close(self) -> None:
        """Stop every model's engine (server shutdown)."""
        for name in list(self.engines):
            self.stop(name)

    def _in_process(self, plan: EnginePlan) -> Engine:
        assert isinstance(plan.config, EngineConfig)
        connector = None
        if self.serving.kvbm is not None:
            connector = build_connector(
                self.serving.kvbm,
                f"{plan.name}-0",
                index=self._index,
                metrics=self._kvbm_metrics,
                model=plan.name,
            )
        # a sharded model's only engine: requests wait for its restarted group, as often as a router migrates
        limit = self.serving.router.migration_limit
        engine = LLMEngine(plan.config, connector, worker_id=f"{plan.name}-0", resume_limit=limit)
        warm_chat_template(engine)
        return engine

    def _routed(self, plan: EnginePlan) -> RoutedEngine:
        standalone = self.serving.kvbm_service is not None
        event_sink = None if standalone else self._index
        transfer = None
        if (
            plan.roles is not None and self.serving.remote_workers is not None
        ):  # decode workers on other hosts
            transfer = KVTransferConfig(self.serving.cluster_secret)
        if plan.roles is None:
            worker_ids = [WorkerId(f"{plan.name}-w{i}") for i in range(plan.workers)]
        else:
            worker_ids = [WorkerId(f"{plan.name}-{role[0]}{i}") for i, role in enumerate(plan.roles)]
        remotes: list[RemoteEngine] = []
        if worker_ids:
            spec: WorkerSpec | ExternalSpec
            envs = None
            if isinstance(plan.config, VLLMConfig):
                spec = self._vllm_spec(plan.config, forward_events=not standalone)
                binds = cpu_binds(plan.config.engine_args, len(worker_ids))  # each on cores of its own
                envs = (  # vLLM's OpenMP threads on those cores, and the rest of the worker's processes
                    None if binds is None else [{CPU_BIND_ENV: bind, WORKER_CPUS_ENV: bind} for bind in binds]
                )
            else:
                spec = WorkerSpec(
                    build_llm_engine,
                    (plan.config, self.serving.kvbm, transfer),
                    forward_events=not standalone,
                    logs=self.serving.logs,
                    tracing=self.serving.tracing,
                )
            remotes = spawn_workers(worker_ids, spec, plan.roles, envs, event_sink=event_sink)
        lookup = self._index
        if standalone:
            lookup = KVIndexClient(self.serving.kvbm_service, service_keys(self.serving.cluster_secret))
        router = Router(self.serving.router, lookup, self._router_metrics)
        disaggregated = {}
        if plan.roles is not None:
            disaggregated = dict(
                prefill_router=Router(self.serving.router, lookup, self._router_metrics),
                disagg=DisaggRule(self.serving.disagg),
            )
        if remotes:
            routed = RoutedEngine(
                remotes, router, remotes[0].info.block_size, BlockHash(remotes[0].info.salt), **disaggregated
            )
        else:  # remote workers only (--workers 0): the layout comes with the first that joins
            routed = RoutedEngine(
                [], router, None, None, model_name=plan.name, max_model_len=plan.config.max_model_len,
                **disaggregated,
            )  # fmt: skip
        if self.serving.remote_workers is not None:
            self._discoveries[plan.name] = self._discover(plan.name, routed, event_sink)
        return routed

    def _vllm_spec(self, config: VLLMConfig, forward_events: bool) -> ExternalSpec:
        assert self.serving.vllm_python is not None
        return ExternalSpec(
            "vllm",
            config.worker_args(self.serving.kvbm),
            self.serving.vllm_python,
            forward_events=forward_events,
            logs=self.serving.logs,
            tracing=self.serving.tracing,
        )

    def _discover(self, name: str, routed: RoutedEngine, event_sink: KVIndex | None) -> Discovery:
        """Follow `name`'s registrations in Redis; remote workers' forwarded block events go to `event_sink`."""
        curve = link_keys(self.serving.cluster_secret)

        def connect(record: WorkerRecord, server_id: str) -> RemoteEngine:
            return RemoteEngine.connect(
                WorkerId(record.worker_id), record.address, server_id, curve, event_sink=event_sink
            )

        return Discovery(Directory(self.serving.remote_workers, name), routed, connect).start()
