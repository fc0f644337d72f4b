"""`strata worker`: one engine on any host, serving whichever server claims it through Redis (registry.py).

The worker binds its channel on TCP (it is the side that is found) and registers its advertised address with
its `WorkerInfo` (hardware and calibrated speeds). Then, in a loop:

    wait for Attach(server_id) -> Hello -> serve that one server -> abort what it left -> "join" again

One server at a time: the claim in Redis keeps other servers away, and each session gets fresh sockets, so a
server that left cannot receive outputs meant for the next one. A server that goes silent (no message, not
even the Ack of a heartbeat, for `lease_s`) is treated as gone: the worker aborts its requests and becomes
available again, so restarting a server never requires restarting its remote workers. SIGTERM/SIGINT: drain
(Draining to the attached server, which routes nothing new here; finish the requests held, for up to
`exit_timeout_s`), say Bye (the server resumes what is left elsewhere), deregister, close the engine, exit 0.

Its ports are open to anyone who can reach them, so a frame that is not a message (protocol.py) is counted in
`messages_rejected`, logged, and answered by dropping the peer: while serving, the worker says Bye to its server
(which migrates its requests) and waits for the next one, still registered; while free, it reopens its sockets.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import redis
import zmq
from prometheus_client import CollectorRegistry

from cluster.curve import CurveKeys
from kvbm.agent import build_connector
from kvbm.config import KVBMConfig
from kvbm.transfer import KVTransferConfig
from server import tracing
from server.engine.api import LocalEngine
from server.engine.config import EngineConfig
from server.tracing import TracingSettings
from server.vllm_engine.config import VLLMConfig
from server.workers.external import SOURCE_ROOT
from server.workers.protocol import Attach, BadMessage, Bye, Hello, WorkerInfo
from server.workers.registry import Registration, WorkerIdTaken, WorkerRecord
from server.workers.status import WorkerStatus
from server.workers.transport import Channel, ChannelAddress, link_keys
from server.workers.worker import (
    MALFORMED,
    ChannelEvents,
    calibrate_logged,
    describe,
    freeze_startup_heap,
    serve_channel,
    start_heartbeat,
    warm_chat_template,
)

if TYPE_CHECKING:  # the vLLM venv runs this module too, and has no tritonclient (model_config's protobufs)
    from server.options import WorkerOptions
    from server.repository.model_config import ModelSource

log = logging.getLogger(__name__)

_PIPE_BYTES = 65536  # Linux's default pipe capacity
_ATTACH_TICK_S = 0.2  # how often a free worker looks at its stop flag while waiting for a server


@dataclass(frozen=True, slots=True)
class RemoteWorkerOptions:
    """Where to bind (`port` and `port + 1`; 0: any two), what to advertise, and the timings (seconds)."""

    worker_id: str
    redis_url: str
    host: str = "0.0.0.0"
    advertise_host: str = "127.0.0.1"
    port: int = 0
    lease_s: float = 3.0
    heartbeat_s: float = 0.5
    exit_timeout_s: float = 30.0  # drain on SIGTERM: finish requests this long before leaving
    curve: CurveKeys | None = None  # from the cluster secret: only servers that hold it can connect
    metrics_port: int | None = None  # HTTP /metrics and probes (server/workers/status.py); None: none


class RemoteWorker:
    """Owns the engine's link to its servers; `run` returns after `stop` is set (e.g. by a signal)."""

    def __init__(
        self,
        engine: LocalEngine,
        info: WorkerInfo,
        options: RemoteWorkerOptions,
        events: ChannelEvents | None = None,
        on_attach: Callable[[], None] | None = None,
    ) -> None:
        """`events`: the engine's KVBM sink when block events go to the attached server's index; `on_attach`
        then asks the KVBM agent to announce what it holds, for the new server's index."""
        self.engine = engine
        self.info = info
        self.options = options
        self.stop = threading.Event()
        self._registered = threading.Event()
        self.messages_rejected = 0  # frames that were not messages (each one dropped its sender's connection)
        self._events = events
        self._on_attach = on_attach
        self._channel = Channel(
            ChannelAddress.tcp(options.host, options.port), server_side=False, curve=options.curve
        )
        self.address = self._channel.address  # wildcard ports resolved: the same ports for every session
        record = WorkerRecord(options.worker_id, self.address.with_host(options.advertise_host), info)
        self.registration = Registration(options.redis_url, record, options.lease_s)

    def ready(self) -> bool:
        """Registered and not draining: servers may send it new requests."""
        return self._registered.is_set() and not self.stop.is_set()

    def run(self) -> None:
        """Register, then serve one server after another until stopped; always deregister."""
        self.registration.register()
        self._registered.set()
        log.info(
            "worker %s of %s registered at %s; %s",
            self.options.worker_id,
            self.info.model_name,
            self.registration.record.address.to_worker,
            self.info.summary(),
        )
        try:
            while not self.stop.is_set():
                self._session()
                if not self.stop.is_set():
                    self._reopen()
                    self.registration.announce("join", "free again")
        finally:
            self._registered.clear()
            self._channel.close()
            self.registration.deregister("worker stopped")

    def _session(self) -> None:
        """Serve the next server that attaches, from its hello to its leaving."""
        server_id = self._wait_for_attach()
        if server_id is None:
            return
        channel = self._channel
        log.info("serving server %s", server_id)
        if self._events is not None:
            self._events.channel = channel
        if self._on_attach is not None:
            self._on_attach()
        channel.send(Hello(self.info))
        beat_stop = threading.Event()
        beat = start_heartbeat(channel, self.engine, self.options.heartbeat_s, beat_stop)
        reason = serve_channel(
            channel, self.engine, self.stop, self.options.lease_s, self.options.exit_timeout_s
        )
        if reason == "signal":
            channel.send(Bye("worker shutting down"))
        elif reason == MALFORMED:
            self.messages_rejected += 1
            channel.send(Bye("a frame that is not a message reached the worker; it dropped this server"))
        beat_stop.set()
        beat.join()
        if self._events is not None:
            self._events.channel = None
        channel.close()
        self.registration.release_claim(server_id)
        log.info("server %s detached (%s)", server_id, reason)

    def _wait_for_attach(self) -> str | None:
        """The id of the server that attached, or None once stopped. A frame that is not a message closes the
        sockets (and with them its sender's connection); the worker waits on fresh ones, on the same ports."""
        while not self.stop.is_set():
            try:
                message = self._channel.recv(timeout_s=_ATTACH_TICK_S)
            except BadMessage as exc:
                self.messages_rejected += 1
                log.error("a frame that is not a message arrived while free (%s); reopening the sockets", exc)
                self._reopen()
                continue
            if isinstance(message, Attach):
                return message.server_id
        return None

    def _reopen(self) -> None:
        """Fresh sockets on the same ports: no peer of the last ones stays connected."""
        self._channel.close()
        self._channel = Channel(self.address, server_side=False, curve=self.options.curve)


def run_worker(
    flags: WorkerOptions, overrides: dict[str, Any], kvbm: KVBMConfig | None, cluster_secret: bytes
) -> int:
    """`strata worker` (the CLI parses the flags into `flags`, the engine `overrides`, the `kvbm` tiers and the
    cluster secret): build the model's engine as `strata serve` would, calibrate, register, serve until
    SIGTERM/SIGINT. Exit code 2 for a bad flag or model (the message names it). A model with backend vllm runs
    under --vllm-python: this process re-executes itself there (`_vllm_worker`)."""
    from server.repository.model_config import VLLM

    try:
        source = _llm_model(flags.model_repository, flags.model)
        traced = TracingSettings(flags.otlp_traces_endpoint, flags.otlp_traces_sample_ratio)
        redis.Redis.from_url(flags.redis_url, socket_connect_timeout=2).ping()
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    except redis.RedisError as exc:
        log.error("--redis-url %s: cannot reach Redis: %s", flags.redis_url, exc)
        return 2
    worker_id = flags.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    advertise = flags.advertise_host or (socket.gethostname() if flags.host == "0.0.0.0" else flags.host)
    options = RemoteWorkerOptions(
        worker_id,
        flags.redis_url,
        flags.host,
        advertise,
        flags.port,
        flags.lease_secs,
        exit_timeout_s=flags.exit_timeout_secs,
        curve=link_keys(cluster_secret),
        metrics_port=flags.metrics_port,
    )
    forward = flags.kvbm_service is None  # else the KVBM agent publishes to Redis for the standalone service
    if source.backend == VLLM:
        return _vllm_worker(flags, source, overrides, kvbm, cluster_secret, options, forward)
    try:
        config = _engine_config(source, flags.model, overrides)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    try:  # disaggregated handoffs: shared memory with workers of this host, a CURVE-authenticated pull across
        transfer = KVTransferConfig(cluster_secret, flags.host, advertise, flags.kv_transfer_port).build()
    except OSError as exc:
        log.error("--kv-transfer-port %d: %s", flags.kv_transfer_port, exc)
        return 2
    from server.engine.llm_engine import LLMEngine

    events = ChannelEvents(None) if forward else None
    connector = build_connector(
        kvbm or KVBMConfig(host_cache_gb=0.0), worker_id, index=events, model=flags.model
    )
    engine = LLMEngine(config, connector, transfer, worker_id=worker_id, on_rank_failure="migrate")
    announce = connector.request_announce if forward else None
    tracing.configure_from(traced, worker_id)
    try:
        return serve_engine(engine, flags.role, options, events, announce, [connector.metrics.registry])
    finally:
        tracing.shutdown()


def serve_engine(
    engine: LocalEngine,
    role: str,
    options: RemoteWorkerOptions,
    events: ChannelEvents | None,
    on_attach: Callable[[], None] | None,
    registries: Sequence[CollectorRegistry] = (),
) -> int:
    """Calibrate `engine`, register it and serve one server after another until SIGTERM/SIGINT; close it.
    `registries`: series of the worker's own (its KVBM tiers') for `--metrics-port`."""
    info = describe(engine, calibrate_logged(engine), role)
    warm_chat_template(engine)
    freeze_startup_heap()
    status = None
    try:
        worker = RemoteWorker(engine, info, options, events, on_attach)
        if options.metrics_port is not None:
            try:
                status = WorkerStatus(options.host, options.metrics_port, engine, worker.ready, registries)
            except OSError as exc:
                log.error("--metrics-port %d: %s", options.metrics_port, exc)
                return 2
            status.start()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: worker.stop.set())
        worker.run()
    except zmq.ZMQError as exc:
        log.error("--host %s --port %d: cannot bind the worker's ports: %s", options.host, options.port, exc)
        return 2
    except (redis.RedisError, WorkerIdTaken) as exc:
        log.error("--redis-url %s: %s", options.redis_url, exc)
        return 2
    finally:
        if status is not None:
            status.close()
        engine.close()  # and its KVBM connector
    log.info("worker %s stopped", options.worker_id)
    return 0


# ---- backend vllm: the worker runs under the vLLM venv's Python ----


class VLLMLaunch(msgspec.Struct, frozen=True):
    """What `strata worker` hands to itself re-executed under --vllm-python, on a pipe (never argv: it holds the
    cluster secret): the engine's factory arguments (VLLMConfig.worker_args) and the worker's options."""

    engine: dict[str, Any]
    worker_id: str
    redis_url: str
    host: str
    advertise_host: str
    port: int
    lease_s: float
    exit_timeout_s: float
    forward_events: bool
    role: str
    cluster_secret: str  # hex
    metrics_port: int | None = None


def _vllm_worker(
    flags: WorkerOptions,
    source: ModelSource,
    overrides: dict[str, Any],
    kvbm: KVBMConfig | None,
    cluster_secret: bytes,
    options: RemoteWorkerOptions,
    forward: bool,
) -> int:
    """A vLLM-backend model: its engine arguments checked here, vLLM run here if this Python has it, else this
    process becomes `--vllm-python -m server.workers.remote_worker` (same pid: signals reach it unchanged)."""
    if flags.role != "both" and kvbm is None:
        log.error("--role %s: backend vllm hands KV over through the KVBM tiers; drop --no-kvbm", flags.role)
        return 2
    try:
        config = VLLMConfig.from_json(source.path / str(source.versions[-1]) / source.model_filename)
    except ValueError as exc:
        log.error("--model %s: %s", flags.model, exc)
        return 2
    config.model_name = flags.model
    config.apply_overrides(overrides)
    launch = VLLMLaunch(
        config.worker_args(kvbm), options.worker_id, options.redis_url, options.host, options.advertise_host,
        options.port, options.lease_s, options.exit_timeout_s, forward, flags.role, cluster_secret.hex(),
        options.metrics_port,
    )  # fmt: skip
    if importlib.util.find_spec("vllm") is not None:
        return _serve_vllm(launch)
    if not flags.vllm_python:
        log.error(
            "--model %s: backend vllm needs a venv with vLLM: give --vllm-python (or STRATA_VLLM_PYTHON); "
            "`make vllm` builds .venv-vllm",
            flags.model,
        )
        return 2
    payload = msgspec.json.encode(launch)
    read, write = os.pipe()
    if len(payload) > _PIPE_BYTES:  # written whole before the reader exists: the pipe must hold all of it
        fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, len(payload))
    os.write(write, payload)
    os.close(write)
    os.set_inheritable(read, True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE_ROOT), env.get("PYTHONPATH")) if p)
    command = [flags.vllm_python, "-m", "server.workers.remote_worker", "--launch-fd", str(read)]
    log.info("backend vllm: continuing under %s", flags.vllm_python)
    try:
        os.execve(flags.vllm_python, command, env)
    except OSError as exc:
        log.error("--vllm-python %s: %s", flags.vllm_python, exc)
        return 2


def _serve_vllm(launch: VLLMLaunch) -> int:
    from server.vllm_engine.engine import build_vllm_engine

    secret = bytes.fromhex(launch.cluster_secret)
    options = RemoteWorkerOptions(
        launch.worker_id, launch.redis_url, launch.host, launch.advertise_host, launch.port, launch.lease_s,
        exit_timeout_s=launch.exit_timeout_s, curve=link_keys(secret), metrics_port=launch.metrics_port,
    )  # fmt: skip
    events = ChannelEvents(None) if launch.forward_events else None
    try:
        engine = build_vllm_engine(**launch.engine, worker_id=launch.worker_id, events=events)
    except ValueError as exc:  # an engine argument vLLM refuses (named with its model.json)
        log.error("%s", exc)
        return 2
    announce = engine.announce if launch.forward_events else None
    return serve_engine(engine, launch.role, options, events, announce)


def main() -> None:
    """`<vllm python> -m server.workers.remote_worker --launch-fd N`: `strata worker` re-executed for vLLM."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--launch-fd", type=int, required=True)
    fd = parser.parse_args().launch_fd
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with os.fdopen(fd, "rb") as pipe:
        launch = msgspec.json.decode(pipe.read(), type=VLLMLaunch)
    sys.exit(_serve_vllm(launch))


# ---- reading the model ----


def _llm_model(repository: Path, model: str) -> ModelSource:
    """`model`'s folder in `repository`, read as `strata serve` reads it; ValueError naming the flag or file unless
    it is an LLM (backend strata_llm or vllm)."""
    from server.repository.model_config import LLM, VLLM
    from server.repository.scan import BrokenModel, read_model

    folder = repository / model
    if not repository.is_dir():
        raise ValueError(f"--model-repository {repository}: not a folder")
    if not folder.is_dir():
        known = sorted(p.name for p in repository.iterdir() if p.is_dir() and not p.name.startswith("."))
        raise ValueError(
            f"--model {model}: no such model in {repository} (found: {', '.join(known) or 'none'})"
        )
    source = read_model(folder)
    if isinstance(source, BrokenModel):
        raise ValueError(f"--model {model}: {source.error}")
    if source.backend not in (LLM, VLLM):
        raise ValueError(
            f"--model {model}: backend {source.backend!r} is not an LLM ({LLM!r} or {VLLM!r}); only LLM "
            "models have workers"
        )
    return source


def _engine_config(source: ModelSource, model: str, overrides: dict[str, Any]) -> EngineConfig:
    config = EngineConfig.from_json(source.path / str(source.versions[-1]) / source.model_filename)
    config.model_name = model
    for key, value in overrides.items():
        setattr(config, key, value)
    config.validate(f"{model} (model.json with command-line overrides)")
    return config


def model_engine_config(repository: Path, model: str, overrides: dict[str, Any]) -> EngineConfig:
    """The engine config `strata serve` would build for a backend strata_llm `model` (its latest version's
    model.json plus the command-line overrides); ValueError naming the flag, the file or the field otherwise."""
    from server.repository.model_config import VLLM

    source = _llm_model(repository, model)
    if source.backend == VLLM:
        raise ValueError(f"--model {model}: backend vllm; this needs a model served by Strata's engine")
    return _engine_config(source, model, overrides)


if __name__ == "__main__":
    main()
