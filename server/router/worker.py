"""The worker process: builds one engine and serves it over a `Channel` until told to stop.

Protocol (pickled tuples), server -> worker:
    ("call", call_id, method, args)   method: submit | encode | apply_chat_template
    ("abort", request_id)
    ("stop",)
worker -> server:
    ("hello", WorkerInfo) once the engine is built, or ("failed", message)
    ("reply", call_id, "ok", value) | ("reply", call_id, "request_error", (field, message)) |
    ("reply", call_id, "error", message)
    ("out", GenerationOutput)         from the engine thread, one per step per request
    ("beat", stats_dict | None)       every `heartbeat_s`; the server declares the worker dead without them
    ("event", TierEvent)              KVBM tier events, when the spec forwards them to the server's index
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvbm.config import KVBMConfig
from kvbm.events import EventSink, TierEvent
from server.engine.api import Engine, GenerationOutput, GenerationRequest, RequestError
from server.engine.config import EngineConfig
from server.router.transport import Channel, ChannelAddress

logger = logging.getLogger(__name__)

_METHODS = ("submit", "encode", "apply_chat_template")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How the worker builds its engine: `factory(*args, worker_id=..., events=...)`, pickled into a spawned
    process. `events` is an EventSink forwarding KVBM tier events to the server's index when `forward_events`
    (embedded mode), else None (the engine's KVBM agent publishes to Redis itself, or nowhere)."""

    factory: Callable[..., Engine]
    args: tuple[Any, ...] = ()
    heartbeat_s: float = 0.5
    forward_events: bool = False
    worker_id: str = "worker-0"  # set by RemoteEngine.spawn


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What the server learns from the worker's hello. `salt`/`block_size` key block hashes (None: not paged)."""

    model_name: str
    max_model_len: int
    max_tokens_limit: int | None
    block_size: int | None
    salt: int | None
    pid: int


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
    channel.send("hello", describe(engine))
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(channel, engine, spec.heartbeat_s, stop), daemon=True)
    beat.start()
    try:
        _serve(channel, engine)
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        stop.set()
        beat.join()
        channel.close()


class ChannelEvents:
    """The worker's KVBM EventSink in embedded mode: forwards tier events to the server's index."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel

    def publish(self, event: TierEvent) -> None:
        self._channel.send("event", event)


def build_llm_engine(engine_config: EngineConfig, kvbm_config: KVBMConfig | None = None, *,
                     worker_id: str, events: EventSink | None) -> Engine:
    """Factory for `WorkerSpec(build_llm_engine, (engine_config, kvbm_config), forward_events=...)`: an
    LLMEngine with a KVBM agent (tiers per `kvbm_config`; G1 only if None) whose events go to `events` (the
    server's index), or with `events` None to the KVBM service over Redis when `kvbm_config.redis_url` is set."""
    from kvbm.agent import build_connector
    from server.engine.llm_engine import LLMEngine

    config = kvbm_config or KVBMConfig(host_cache_gb=0.0)
    return LLMEngine(engine_config, build_connector(config, worker_id, index=events))


def describe(engine: Engine) -> WorkerInfo:
    layout = getattr(engine, "layout", None)
    config = getattr(engine, "config", None)
    return WorkerInfo(
        model_name=engine.model_name, max_model_len=engine.max_model_len,
        max_tokens_limit=getattr(engine, "max_tokens_limit", getattr(config, "max_tokens_limit", None)),
        block_size=getattr(layout, "block_size", None), salt=getattr(engine, "salt", None), pid=os.getpid())


def _serve(channel: Channel, engine: Engine) -> None:
    def sink(output: GenerationOutput) -> None:
        channel.send("out", output)

    while True:
        message = channel.recv()
        kind = message[0]
        if kind == "stop":
            return
        if kind == "abort":
            engine.abort(message[1])
        elif kind == "call":
            channel.send("reply", message[1], *_call(engine, message[2], message[3], sink))


def _call(engine: Engine, method: str, args: tuple[Any, ...], sink: Callable[[GenerationOutput], None]
          ) -> tuple[str, Any]:
    if method not in _METHODS:
        return "error", f"unknown method {method!r}"
    try:
        if method == "submit":
            request: GenerationRequest = args[0]
            engine.submit(request, sink)
            return "ok", None
        return "ok", getattr(engine, method)(*args)
    except RequestError as exc:
        return "request_error", (exc.field, exc.message)
    except Exception as exc:
        logger.exception("%s failed", method)
        return "error", f"{type(exc).__name__} in worker {method}"


def _heartbeat(channel: Channel, engine: Engine, interval_s: float, stop: threading.Event) -> None:
    """Beat with the engine's pool stats; exit the process if the server that spawned it is gone."""
    parent = os.getppid()
    stats = getattr(engine, "stats", None)
    while not stop.wait(interval_s):
        if os.getppid() != parent:
            logger.error("server process is gone; exiting")
            os._exit(1)
        channel.send("beat", dataclasses.asdict(stats()) if stats is not None else None)
