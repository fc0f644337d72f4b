"""The worker process: builds one engine and serves it over a `Channel` until told to stop.

The messages are the typed Structs of `protocol.py` (its docstring lists both directions). The worker answers
each call (Submit, Encode, ApplyChatTemplate) with one answer (Accepted or TokenIds, Refused, CallFailed), streams
its requests' outputs (Out) from the engine thread, beats with its engine's PoolStats, and forwards KVBM tier events
when its spec says so. A frame that is not a message (`BadMessage`) ends serving that server: a spawned worker exits
(its server sees a dead worker and migrates its requests), a remote worker says Bye and waits for its next server.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvbm.config import KVBMConfig
from kvbm.events import EventSink, TierEvent
from kvbm.transfer import KVTransferConfig
from server import tracing
from server.engine.api import (
    EngineOverloaded,
    GenerationOutput,
    LocalEngine,
    RequestError,
    RequestId,
    turn_dicts,
)
from server.engine.config import EngineConfig
from server.logs import LogSettings, configure_logging
from server.tracing import TracingSettings
from server.workers.hardware import Speeds, calibrate, describe_hardware
from server.workers.protocol import (
    Abort,
    Accepted,
    Answer,
    BadMessage,
    Beat,
    Busy,
    Call,
    CallFailed,
    Decode,
    Draining,
    Encode,
    Event,
    Failed,
    Hello,
    Out,
    Refused,
    Stop,
    Submit,
    Text,
    TokenIds,
    WorkerInfo,
)
from server.workers.transport import Channel, ChannelAddress

logger = logging.getLogger(__name__)

MALFORMED = "malformed message"  # why serving ended when the server's end sent a frame that is not a message


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
    role: str = "both"  # prefill | decode | both: what the router sends it (server/router/disagg.py)
    logs: LogSettings = LogSettings()  # the server's --log-file, --log-format
    tracing: TracingSettings = TracingSettings()  # the server's --otlp-traces-*


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
    configure_logging(spec.logs, logging.INFO, spec.worker_id)
    tracing.configure_from(spec.tracing, spec.worker_id)
    channel = Channel(address, server_side=False)

    def build(events: EventSink | None) -> LocalEngine:
        return spec.factory(*spec.args, worker_id=spec.worker_id, events=events)

    try:
        run_worker(channel, build, spec.forward_events, spec.role, spec.heartbeat_s)
    finally:
        tracing.shutdown()  # export the spans still buffered


def run_worker(
    channel: Channel,
    build: Callable[[EventSink | None], LocalEngine],
    forward_events: bool,
    role: str,
    heartbeat_s: float,
) -> None:
    """A spawned worker's life on its channel: build the engine (Failed if that raises), say Hello, beat, serve
    until Stop; `build` gets the EventSink of forwarded KVBM events, or None."""
    try:
        engine = build(ChannelEvents(channel) if forward_events else None)
    except Exception as exc:
        logger.exception("building the engine failed")
        channel.send(Failed(f"{type(exc).__name__}: {exc}"))
        channel.close()
        return
    info = describe(engine, calibrate_logged(engine), role)
    warm_chat_template(engine)
    freeze_startup_heap()
    channel.send(Hello(info))
    stop = threading.Event()
    beat = start_heartbeat(channel, engine, heartbeat_s, stop, parent_pid=os.getppid())
    try:
        reason = serve_channel(channel, engine)
        logger.info("serving ended: %s", reason)
    finally:
        stop.set()  # before the engine closes: a closed engine is not healthy, and that is no reason to exit
        beat.join()
        engine.close()
        channel.close()


def warm_chat_template(engine: LocalEngine) -> None:
    """Render a chat once, on a thread of its own: the first chat request to an engine otherwise waits for its
    tokenizer's chat template to load (1.5 s here, seen in a trace of a worker's first chat). After calibration,
    whose speeds it would skew."""

    def render() -> None:
        try:
            engine.apply_chat_template([{"role": "user", "content": "warm-up"}])
        except Exception:  # a model without a chat template: its chat requests get the error, not the warm-up
            logger.debug("chat template warm-up failed", exc_info=True)

    threading.Thread(target=render, name="chat-template-warm-up", daemon=True).start()


def freeze_startup_heap() -> None:
    """Once the engine is up: move every object made so far out of the garbage collector's sight (gc.freeze, as
    vLLM's API server does), so that a full collection scans only what came since. A collection holds the GIL,
    and a heartbeat waits for it: over a whole vLLM or torch heap that pause is long on an idle core and many
    times longer on one shared with busy engines, long enough for the server to declare a live worker dead."""
    gc.collect()
    gc.freeze()


def calibrate_logged(engine: LocalEngine) -> Speeds:
    started = time.monotonic()
    speeds = calibrate(engine)
    logger.info(
        "calibrated in %.2f s: prefill %.0f tok/s, decode %.1f tok/s",
        time.monotonic() - started,
        speeds.prefill_tok_s,
        speeds.decode_tok_s,
    )
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
            channel.send(Event(event))


def build_llm_engine(
    engine_config: EngineConfig,
    kvbm_config: KVBMConfig | None = None,
    transfer: KVTransferConfig | None = None,
    *,
    worker_id: str,
    events: EventSink | None,
) -> LocalEngine:
    """Factory for `WorkerSpec(build_llm_engine, (engine_config, kvbm_config[, transfer]), forward_events=...)`:
    an LLMEngine with a KVBM agent (tiers per `kvbm_config`; G1 only if None) whose events go to `events` (the
    server's index), or with `events` None to the KVBM service over Redis when `kvbm_config.redis_url` is set;
    disaggregated handoffs move as `transfer` says (default: shared memory on this host only)."""
    import setproctitle

    from kvbm.agent import build_connector
    from server.engine.llm_engine import LLMEngine
    from server.engine.parallel.group import rank_title

    config = kvbm_config or KVBMConfig(host_cache_gb=0.0)
    kv_transfer = (transfer or KVTransferConfig()).build()
    connector = build_connector(config, worker_id, index=events, model=engine_config.model_name or "")
    world = engine_config.world_size
    if world > 1:  # this process is the group's driver
        setproctitle.setproctitle(rank_title(engine_config.model_name or "model", worker_id, 0, world))
    # a group that loses a rank hands its requests back: the router resumes them on another worker meanwhile
    return LLMEngine(engine_config, connector, kv_transfer, worker_id=worker_id, on_rank_failure="migrate")


def describe(engine: LocalEngine, speeds: Speeds, role: str = "both") -> WorkerInfo:
    layout = engine.block_layout
    return WorkerInfo(
        model_name=engine.model_name,
        max_model_len=engine.max_model_len,
        max_tokens_limit=engine.max_tokens_limit,
        block_size=layout.block_size if layout is not None else None,
        salt=layout.salt if layout is not None else None,
        pid=os.getpid(),
        hardware=describe_hardware(engine),
        speeds=speeds,
        role=role,
        shards=engine.shard_layout,
    )


_TICK_S = 0.2  # how often a remote worker's serve loop looks at its stop flag and its server's silence


def serve_channel(
    channel: Channel,
    engine: LocalEngine,
    stop: threading.Event | None = None,
    server_timeout_s: float | None = None,
    drain_s: float = 0.0,
) -> str:
    """Answer one server's messages until it sends Stop; then abort what it left running on the engine.

    Returns why serving ended: "stop"; `MALFORMED` after a frame that is not a message (logged; whoever sent it,
    this server is dropped); or for a remote worker (`stop` given) "server silent" after `server_timeout_s`
    without a message (the server acks every beat), or "signal" once `stop` is set and the worker has drained:
    it says Draining (the server routes nothing new to it) and serves on until its requests finish or `drain_s`
    passes. What is still running then is aborted without a word to the server: the caller says Bye, and the
    server resumes those requests on another worker.
    """
    active: set[RequestId] = set()
    silenced = threading.Event()

    def sink(output: GenerationOutput) -> None:
        # sent before it leaves `active`: once the drain sees `active` empty, every final output is on the link
        # ahead of the caller's Bye (after which the server would resume the request elsewhere)
        if not silenced.is_set():
            channel.send(Out(output))
        if output.finished:
            active.discard(output.request_id)

    reason = _answer(channel, engine, sink, active, stop, server_timeout_s, drain_s)
    if reason == "signal":
        silenced.set()
    for request_id in list(active):
        engine.abort(request_id)
    return reason


def _answer(
    channel: Channel,
    engine: LocalEngine,
    sink: Callable[[GenerationOutput], None],
    active: set[RequestId],
    stop: threading.Event | None,
    server_timeout_s: float | None,
    drain_s: float,
) -> str:
    last_heard = time.monotonic()
    drain_until: float | None = None
    while True:
        if stop is not None and stop.is_set():
            if drain_until is None:
                logger.info("draining: %d request(s) to finish within %.0f s", len(active), drain_s)
                channel.send(Draining("worker shutting down"))
                drain_until = time.monotonic() + drain_s
            if not active or time.monotonic() >= drain_until:
                return "signal"
        try:
            message = channel.recv(timeout_s=None if stop is None else _TICK_S)
        except BadMessage as exc:
            logger.error("dropping the server: a frame that is not a message arrived (%s)", exc)
            return MALFORMED
        if message is None:
            if server_timeout_s is not None and time.monotonic() - last_heard > server_timeout_s:
                return "server silent"
            continue
        last_heard = time.monotonic()  # any message, an Ack included
        if isinstance(message, Stop):
            return "stop"
        if isinstance(message, Abort):
            engine.abort(message.request_id)
        elif isinstance(message, Call):
            _send_answer(channel, _call(engine, message, sink, active))


def _call(
    engine: LocalEngine, call: Call, sink: Callable[[GenerationOutput], None], active: set[RequestId]
) -> Answer:
    try:
        if isinstance(call, Submit):
            active.add(call.request.request_id)
            try:
                engine.submit(call.request, sink)
            except BaseException:
                active.discard(call.request.request_id)
                raise
            return Accepted(call.call_id)
        if isinstance(call, Encode):
            return TokenIds(call.call_id, engine.encode(call.text))
        if isinstance(call, Decode):
            return Text(call.call_id, engine.decode(call.token_ids))
        return TokenIds(call.call_id, engine.apply_chat_template(turn_dicts(call.messages), call.tools))
    except RequestError as exc:
        return Refused(call.call_id, exc.field, exc.message)
    except EngineOverloaded as exc:
        return Busy(call.call_id, str(exc), exc.retry_after_s)
    except Exception as exc:
        logger.exception("%s failed", type(call).__name__)
        return CallFailed(call.call_id, f"{type(exc).__name__} in worker {type(call).__name__}")


def _send_answer(channel: Channel, answer: Answer) -> None:
    try:
        channel.send(answer)
    except BadMessage as exc:  # e.g. the token ids of a huge text: the caller gets an error, not a lost link
        channel.send(CallFailed(answer.call_id, f"answer not sent: {exc}"))


LATE_BEAT_S = 2.0  # a beat this much later than its interval is logged


def start_heartbeat(
    channel: Channel,
    engine: LocalEngine,
    interval_s: float,
    stop: threading.Event,
    parent_pid: int | None = None,
) -> threading.Thread:
    """Beat with the engine's pool stats until `stop`; with `parent_pid` (a spawned worker), exit the process
    if the server that spawned it is gone. A worker whose engine died (its thread, or vLLM's engine core) exits
    too: its server sees a dead worker and resumes its requests elsewhere, instead of routing to a corpse."""

    def beat() -> None:
        last = time.monotonic()
        while not stop.wait(interval_s):
            late_s, last = time.monotonic() - last - interval_s, time.monotonic()
            if late_s > LATE_BEAT_S:  # the server declares a worker dead after a few such gaps: say why
                logger.warning("heartbeat %.1f s late: this process did not run (CPU or GIL starved)", late_s)
            if parent_pid is not None and os.getppid() != parent_pid:
                logger.error("server process is gone; exiting")
                os._exit(1)
            if not engine.healthy and not stop.is_set():
                logger.error("the engine is dead; worker exiting so that its requests move elsewhere")
                os._exit(1)
            channel.send(Beat(engine.stats()))

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    return thread
