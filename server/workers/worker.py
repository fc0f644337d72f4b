"""The worker process: builds one engine and serves it over a `Channel` until told to stop.

Protocol (pickled tuples), server -> worker:
    ("call", call_id, method, args)   method: submit | encode | apply_chat_template
    ("abort", request_id)
    ("stop",)
worker -> server:
    ("ack",)                          answers each beat: a remote worker drops a server it no longer hears
    ("attach", server_id)             a server connecting to a remote worker (see remote_worker.py)
worker -> server:
    ("hello", WorkerInfo) once the engine is built and calibrated, or ("failed", message)
    ("reply", call_id, "ok", value) | ("reply", call_id, "request_error", (field, message)) |
    ("reply", call_id, "error", message)
    ("out", GenerationOutput)         from the engine thread, one per step per request
    ("beat", PoolStats)               every `heartbeat_s`; the server declares the worker dead without them
    ("event", TierEvent)              KVBM tier events, when the spec forwards them to the server's index
    ("bye", reason)                   a remote worker leaving (SIGTERM): the server drops it at once
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbm.config import KVBMConfig
from kvbm.events import EventSink, TierEvent
from server.engine.api import GenerationOutput, GenerationRequest, LocalEngine, RequestError, RequestId
from server.engine.config import EngineConfig
from server.workers.hardware import HardwareInfo, Speeds, calibrate, describe_hardware
from server.workers.transport import Channel, ChannelAddress

logger = logging.getLogger(__name__)

_METHODS = ("submit", "encode", "apply_chat_template")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How the worker builds its engine: `factory(*args, worker_id=..., events=...)`, pickled into a spawned
    process. `events` is an EventSink forwarding KVBM tier events to the server's index when `forward_events`
    (embedded mode), else None (the engine's KVBM agent publishes to Redis itself, or nowhere)."""

    factory: Callable[..., LocalEngine]
    args: tuple[Any, ...] = ()
    heartbeat_s: float = 0.5
    forward_events: bool = False
    worker_id: str = "worker-0"  # set by RemoteEngine.spawn


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What the server learns from the worker's hello (and from Redis, as JSON, for a remote worker).
    `salt`/`block_size` key block hashes (None: not paged); `speeds` were measured at start (see hardware.py)."""

    model_name: str
    max_model_len: int
    max_tokens_limit: int
    block_size: int | None
    salt: int | None
    pid: int
    hardware: HardwareInfo | None = None
    speeds: Speeds = field(default_factory=Speeds)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> WorkerInfo:
        hardware = raw.get("hardware")
        return cls(**{**raw, "hardware": HardwareInfo(**hardware) if hardware else None,
                      "speeds": Speeds(**raw.get("speeds", {}))})

    def summary(self) -> str:
        """One log line: where it runs and how fast it measured."""
        hw = self.hardware
        where = f"{hw.host} {hw.device} ({hw.device_name}), {hw.cpu_cores} cores, {hw.torch_threads} threads, " \
            f"{hw.memory_bytes / 2**30:.1f} GiB, KV {hw.kv_capacity_blocks} blocks / " \
            f"{hw.kv_capacity_bytes / 2**20:.0f} MiB" if hw else "unknown hardware"
        return f"{where}; prefill {self.speeds.prefill_tok_s:.0f} tok/s, decode {self.speeds.decode_tok_s:.1f} tok/s"


def _exit_with_parent() -> None:
    """End this worker when the server process dies, even by kill -9 (no orphaned engines holding memory).

    A spawned child holds the read end of a pipe whose write end only the parent has: it becomes readable (EOF)
    exactly when the parent is gone. (PR_SET_PDEATHSIG would fire when the *thread* that spawned us exits.)
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        logger.warning("server process is gone; worker exiting")
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main(spec: WorkerSpec, address: ChannelAddress) -> None:
    """Entry point of the spawned process."""
    _exit_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker[{os.getpid()}] %(levelname)s %(message)s")
    channel = Channel(address, server_side=False)
    try:
        events = ChannelEvents(channel) if spec.forward_events else None
        engine = spec.factory(*spec.args, worker_id=spec.worker_id, events=events)
    except Exception as exc:
        logger.exception("building the engine failed")
        channel.send("failed", f"{type(exc).__name__}: {exc}")
        channel.close()
        return
    channel.send("hello", describe(engine, calibrate_logged(engine)))
    stop = threading.Event()
    beat = start_heartbeat(channel, engine, spec.heartbeat_s, stop, parent_pid=os.getppid())
    try:
        serve_channel(channel, engine)
    finally:
        engine.close()
        stop.set()
        beat.join()
        channel.close()


def calibrate_logged(engine: LocalEngine) -> Speeds:
    started = time.monotonic()
    speeds = calibrate(engine)
    logger.info("calibrated in %.2f s: prefill %.0f tok/s, decode %.1f tok/s", time.monotonic() - started,
                speeds.prefill_tok_s, speeds.decode_tok_s)
    return speeds


class ChannelEvents:
    """The worker's KVBM EventSink in embedded mode: forwards tier events to the server's index. A remote worker
    sets `channel` per server it serves; events while none is attached are dropped (a new server's index learns
    the worker's blocks from the announcement its connector makes on request)."""

    def __init__(self, channel: Channel | None) -> None:
        self.channel = channel

    def publish(self, event: TierEvent) -> None:
        channel = self.channel
        if channel is not None:
            channel.send("event", event)


def build_llm_engine(engine_config: EngineConfig, kvbm_config: KVBMConfig | None = None, *,
                     worker_id: str, events: EventSink | None) -> LocalEngine:
    """Factory for `WorkerSpec(build_llm_engine, (engine_config, kvbm_config), forward_events=...)`: an
    LLMEngine with a KVBM agent (tiers per `kvbm_config`; G1 only if None) whose events go to `events` (the
    server's index), or with `events` None to the KVBM service over Redis when `kvbm_config.redis_url` is set."""
    from kvbm.agent import build_connector
    from server.engine.llm_engine import LLMEngine

    config = kvbm_config or KVBMConfig(host_cache_gb=0.0)
    return LLMEngine(engine_config, build_connector(config, worker_id, index=events))


def describe(engine: LocalEngine, speeds: Speeds) -> WorkerInfo:
    layout = engine.block_layout
    return WorkerInfo(
        model_name=engine.model_name, max_model_len=engine.max_model_len, max_tokens_limit=engine.max_tokens_limit,
        block_size=layout.block_size if layout is not None else None,
        salt=layout.salt if layout is not None else None, pid=os.getpid(),
        hardware=describe_hardware(engine), speeds=speeds)


_TICK_S = 0.2  # how often a remote worker's serve loop looks at its stop flag and its server's silence


def serve_channel(channel: Channel, engine: LocalEngine, stop: threading.Event | None = None,
                  server_timeout_s: float | None = None) -> str:
    """Answer one server's messages until it sends "stop"; then abort what it left running on the engine.

    Returns why serving ended: "stop", or for a remote worker (`stop` given) "signal" once `stop` is set, or
    "server silent" after `server_timeout_s` without a message (the server acks every beat).
    """
    active: set[RequestId] = set()

    def sink(output: GenerationOutput) -> None:
        if output.finished:
            active.discard(output.request_id)
        channel.send("out", output)

    reason = _answer(channel, engine, sink, active, stop, server_timeout_s)
    for request_id in list(active):
        engine.abort(request_id)
    return reason


def _answer(channel: Channel, engine: LocalEngine, sink: Callable[[GenerationOutput], None], active: set[RequestId],
            stop: threading.Event | None, server_timeout_s: float | None) -> str:
    last_heard = time.monotonic()
    while True:
        message = channel.recv(timeout_s=None if stop is None else _TICK_S)
        if message is None:
            if stop is not None and stop.is_set():
                return "signal"
            if server_timeout_s is not None and time.monotonic() - last_heard > server_timeout_s:
                return "server silent"
            continue
        last_heard = time.monotonic()
        kind = message[0]
        if kind == "stop":
            return "stop"
        if kind == "abort":
            engine.abort(message[1])
        elif kind == "call":
            channel.send("reply", message[1], *_call(engine, message[2], message[3], sink, active))


def _call(engine: LocalEngine, method: str, args: tuple[Any, ...], sink: Callable[[GenerationOutput], None],
          active: set[RequestId]) -> tuple[str, Any]:
    if method not in _METHODS:
        return "error", f"unknown method {method!r}"
    try:
        if method == "submit":
            request: GenerationRequest = args[0]
            active.add(request.request_id)
            try:
                engine.submit(request, sink)
            except BaseException:
                active.discard(request.request_id)
                raise
            return "ok", None
        return "ok", getattr(engine, method)(*args)
    except RequestError as exc:
        return "request_error", (exc.field, exc.message)
    except Exception as exc:
        logger.exception("%s failed", method)
        return "error", f"{type(exc).__name__} in worker {method}"


def start_heartbeat(channel: Channel, engine: LocalEngine, interval_s: float, stop: threading.Event,
                    parent_pid: int | None = None) -> threading.Thread:
    """Beat with the engine's pool stats until `stop`; with `parent_pid` (a spawned worker), exit the process
    if the server that spawned it is gone."""
    def beat() -> None:
        while not stop.wait(interval_s):
            if parent_pid is not None and os.getppid() != parent_pid:
                logger.error("server process is gone; exiting")
                os._exit(1)
            channel.send("beat", engine.stats())

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    return thread
