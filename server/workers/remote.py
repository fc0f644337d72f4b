"""`RemoteEngine`: the Engine Protocol over a worker process (messages: protocol.py).

Two kinds of worker: one this server spawned (`spawn`, ipc; its process is watched too), and one on any host
that registered in Redis (`connect`, TCP; liveness is heartbeats alone, and Bye when it leaves).

One receiver thread per worker reads outputs, answers and heartbeats (each acked, so a remote worker knows its
server is alive), hands each output to its request's sink, and watches liveness: a worker that exits, is
killed, leaves, or misses heartbeats for `heartbeat_timeout_s` is declared dead within that time (exit: within
`_TICK_S`); every unfinished request then gets a final output with finish_reason "error", pending calls raise
`WorkerDied`, and death listeners run. A remote worker told to stop says Draining first (`draining`, and
listeners' `on_draining`): nothing new should go to it; its requests finish there. A frame on the link that is not a message (`BadMessage`) is counted
(`messages_rejected`, and listeners' `on_rejected`) and the worker is dropped as dead: a spawned one is killed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

import msgspec

from cluster.curve import CurveKeys
from kvbm.events import EventSink
from server.engine.api import (
    EngineOverloaded,
    EngineUnavailable,
    GenerationOutput,
    GenerationRequest,
    KVBlockLayout,
    OutputSink,
    PoolStats,
    RequestError,
    RequestId,
    chat_turns,
    max_output_tokens,
)
from server.workers import external
from server.workers.external import ExternalSpec
from server.workers.protocol import (
    Abort,
    Accepted,
    Ack,
    Answer,
    ApplyChatTemplate,
    Attach,
    BadMessage,
    Beat,
    Busy,
    Bye,
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
    WorkerId,
    WorkerInfo,
)
from server.workers.transport import Channel, ChannelAddress
from server.workers.worker import WorkerSpec, worker_main

logger = logging.getLogger(__name__)

_TICK_S = 0.1  # how often the receiver looks at the process when no message arrives


class WorkerDied(EngineUnavailable):
    """The worker process exited or stopped answering."""


class WorkerProcess(Protocol):
    """A worker process this server started: multiprocessing's Process, or `external.ChildProcess`."""

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


class WorkerListener(Protocol):
    """Told about a worker's life, on its receiver thread (the router: `RoutedEngine`)."""

    def on_beat(self, worker: RemoteEngine) -> None:
        """A heartbeat arrived; `worker.stats()` is its report."""
        ...

    def on_death(self, worker: RemoteEngine) -> None:
        """The worker died or left (once); its unfinished requests end right after this returns."""
        ...

    def on_draining(self, worker: RemoteEngine) -> None:
        """The worker is stopping (once): route nothing new to it; what it holds finishes there (or, if it
        leaves first, ends with on_death as usual)."""
        ...

    def on_rejected(self, worker: RemoteEngine) -> None:
        """A frame on the worker's link was not a message; the worker is dropped (on_death follows)."""
        ...


class RemoteEngine:
    """Implements `server.engine.api.Engine` over one worker."""

    def __init__(
        self,
        worker_id: WorkerId,
        process: WorkerProcess | None,
        channel: Channel,
        info: WorkerInfo,
        heartbeat_timeout_s: float,
        call_timeout_s: float,
        event_sink: EventSink | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.info = info
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.block_layout = (
            KVBlockLayout(info.block_size, info.salt)
            if info.block_size is not None and info.salt is not None
            else None
        )
        self.messages_rejected = 0  # frames on the link that were not messages (each one drops the worker)
        self.draining = False  # the worker said Draining: it takes nothing new
        self._stats = PoolStats(
            0, 0, 0, 0, 0, 0
        )  # the worker's last report (zeros until its first heartbeat)
        self._process = process
        self._channel = channel
        self._event_sink = event_sink
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._call_timeout_s = call_timeout_s
        self._sinks: dict[RequestId, OutputSink] = {}
        self._calls: dict[int, Future[Accepted | TokenIds | Text]] = {}
        self._submitting: dict[
            int, RequestId
        ] = {}  # Submit calls not answered yet: their caller gets the error
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self._listeners: list[WorkerListener] = []
        self._last_heard = time.monotonic()
        self._dead: str | None = None
        self._closing = False  # the server is stopping this worker: its requests end, nothing is resumed
        self._leaving = (
            False  # the worker said bye (orderly): not logged as a failure, its requests resumable
        )
        self._receiver = threading.Thread(target=self._receive_loop, name=f"remote-{worker_id}", daemon=True)
        self._receiver.start()

    @classmethod
    def spawn(
        cls,
        worker_id: WorkerId,
        spec: WorkerSpec | ExternalSpec,
        start_timeout_s: float = 300.0,
        # its exit is seen at once (the process is watched); silence this long means hung: 5 s once fell to a
        # live vLLM worker sharing 2 cores with another vLLM engine
        heartbeat_timeout_s: float = 10.0,
        call_timeout_s: float = 60.0,
        event_sink: EventSink | None = None,
    ) -> RemoteEngine:
        """Start a worker process (spawn, or under another Python for an `ExternalSpec`) and wait until its
        engine is built; its forwarded KVBM events (see
        `WorkerSpec.forward_events`) go to `event_sink` (the router's index in embedded mode)."""
        spec = replace_spec(spec, worker_id=worker_id)
        address = ChannelAddress.fresh()
        channel = Channel(address, server_side=True)
        process: WorkerProcess
        if isinstance(spec, ExternalSpec):  # under another Python (the engine's own venv)
            process = external.start(spec, address)
        else:
            process = multiprocessing.get_context("spawn").Process(
                target=worker_main, args=(spec, address), name=f"strata-worker-{worker_id}", daemon=True
            )
            process.start()
        try:
            info = _wait_for_hello(
                worker_id, process, channel, time.monotonic() + start_timeout_s, event_sink
            )
        except WorkerDied:
            process.kill()
            process.join(10)
            channel.close()
            raise
        logger.info(
            "worker %s up: pid %d, model %s; %s", worker_id, info.pid, info.model_name, info.summary()
        )
        return cls(worker_id, process, channel, info, heartbeat_timeout_s, call_timeout_s, event_sink)

    @classmethod
    def connect(
        cls,
        worker_id: WorkerId,
        address: ChannelAddress,
        server_id: str,
        curve: CurveKeys,
        start_timeout_s: float = 10.0,
        heartbeat_timeout_s: float = 3.0,
        call_timeout_s: float = 60.0,
        event_sink: EventSink | None = None,
    ) -> RemoteEngine:
        """Attach to a worker that bound `address` (a `strata worker` on any host) and wait for its hello. The
        caller holds the worker's claim: a bound worker must have one server at a time (see transport.py).
        `curve`: keys from the cluster secret; with another secret than the worker's no hello ever comes."""
        channel = Channel(address, server_side=True, curve=curve)
        channel.send(Attach(server_id))
        try:
            info = _wait_for_hello(worker_id, None, channel, time.monotonic() + start_timeout_s, event_sink)
        except WorkerDied as exc:
            channel.close()
            raise WorkerDied(
                f"{exc} (unreachable at {address.to_worker}, or it holds another cluster secret)"
            ) from None
        return cls(worker_id, None, channel, info, heartbeat_timeout_s, call_timeout_s, event_sink)

    @property
    def max_tokens_limit(self) -> int:
        return self.info.max_tokens_limit

    @property
    def alive(self) -> bool:
        return self._dead is None

    @property
    def healthy(self) -> bool:
        return self._dead is None

    def add_listener(self, listener: WorkerListener) -> None:
        self._listeners.append(listener)

    def stats(self) -> PoolStats:
        return self._stats

    def encode(self, text: str) -> list[int]:
        return self._tokens(Encode(next(self._call_ids), text))

    def decode(self, token_ids: Sequence[int]) -> str:
        answer = self._call(Decode(next(self._call_ids), list(token_ids)))
        if not isinstance(answer, Text):
            raise RuntimeError(f"worker {self.worker_id} answered Decode with {type(answer).__name__}")
        return answer.text

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        turns = chat_turns(messages)
        return self._tokens(
            ApplyChatTemplate(next(self._call_ids), turns, None if tools is None else list(tools))
        )

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        """Synchronous: a RequestError from the worker's engine is raised here (one round trip). The
        sampling fields are checked here first, so that what is sent decodes on the worker (a frame that does not
        would make the worker drop this server)."""
        request.sampling.validate(max_output_tokens(self, len(request.prompt_token_ids)))
        call = Submit(next(self._call_ids), request)
        with self._lock:
            self._sinks[request.request_id] = sink
            self._submitting[call.call_id] = request.request_id
        try:
            self._call(call)
        except BaseException:
            with self._lock:
                self._sinks.pop(request.request_id, None)
            raise
        finally:
            with self._lock:
                self._submitting.pop(call.call_id, None)

    def abort(self, request_id: RequestId) -> None:
        if self._dead is None:
            self._channel.send(Abort(request_id))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the worker (its engine aborts what is left): a spawned one exits, a remote one detaches and
        waits for its next server. Then stop the receiver."""
        self._closing = True
        if self._dead is None:
            self._channel.send(Stop())
        if self._process is not None:
            self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout_s)
        self._die("closed")
        self._receiver.join(timeout_s)
        self._channel.close()

    def drop(self, reason: str) -> None:
        """Stop routing to this worker because something other than its link says it is gone (its lease expired):
        unlike `close`, its unfinished requests end as retryable, so the router resumes them elsewhere. A worker
        that is in fact alive is told to stop serving this server and joins again when it registers anew."""
        if self._dead is None:
            try:
                self._channel.send(Stop())
            except Exception as exc:  # noqa: BLE001 - the link may be gone already; dropping goes on regardless
                logger.info("worker %s: its Stop was not sent (%s); dropping it anyway", self.worker_id, exc)
        self._die(reason)
        self.close()

    def kill(self) -> None:
        """Kill the worker process at once (tests, and a worker that stopped answering); spawned workers only."""
        if self._process is not None:
            self._process.kill()

    def _tokens(self, call: Encode | ApplyChatTemplate) -> list[int]:
        answer = self._call(call)
        if not isinstance(answer, TokenIds):
            raise RuntimeError(
                f"worker {self.worker_id} answered {type(call).__name__} with {type(answer).__name__}"
            )
        return answer.token_ids

    def _call(self, call: Call) -> Accepted | TokenIds | Text:
        """Send `call` and wait for its answer; Refused raises RequestError, CallFailed RuntimeError."""
        if self._dead is not None:
            raise WorkerDied(f"worker {self.worker_id} is dead: {self._dead}")
        future: Future[Accepted | TokenIds | Text] = Future()
        with self._lock:
            self._calls[call.call_id] = future
        try:
            try:
                self._channel.send(call)
            except BadMessage as exc:
                field = "messages" if isinstance(call, ApplyChatTemplate) else "prompt"
                raise RequestError(field, f"too large for a worker: {exc}") from None
            return future.result(timeout=self._call_timeout_s)
        finally:
            with self._lock:
                self._calls.pop(call.call_id, None)

    def _receive_loop(self) -> None:
        while self._dead is None:
            try:
                message = self._channel.recv(timeout_s=_TICK_S)
            except BadMessage as exc:
                self._reject(exc)
                return
            if message is None:
                self._check_liveness()
                continue
            self._last_heard = time.monotonic()
            if isinstance(message, Out):
                self._deliver(message.output)
            elif isinstance(message, Event):
                if self._event_sink is not None:
                    self._event_sink.publish(message.event)
            elif isinstance(message, Answer):
                self._resolve(message)
            elif isinstance(message, Beat):
                self._channel.send(Ack())
                self._stats = message.stats
                self._check_liveness()
                for listener in self._listeners:
                    listener.on_beat(self)
            elif isinstance(message, Draining):
                with self._lock:
                    unfinished = len(self._sinks)
                logger.info(
                    "worker %s is draining (%s): %d request(s) to finish there",
                    self.worker_id,
                    message.reason,
                    unfinished,
                )
                self.draining = True
                for listener in self._listeners:
                    listener.on_draining(self)
            elif isinstance(message, Bye):
                logger.info("worker %s is leaving: %s", self.worker_id, message.reason)
                self._leaving = True
                self._die(f"worker left ({message.reason})")

    def _reject(self, error: BadMessage) -> None:
        """A frame that is not a message: whoever sent it, this link can no longer be trusted."""
        self.messages_rejected += 1
        logger.error(
            "worker %s's link carried a frame that is not a message (%s); dropping the worker",
            self.worker_id,
            error,
        )
        for listener in self._listeners:
            listener.on_rejected(self)
        self.kill()
        self._die(f"malformed message ({error})")

    def _deliver(self, output: GenerationOutput) -> None:
        with self._lock:
            # a request already ended here (the worker was dropped, or its submit failed) has no sink any more
            sink = (
                self._sinks.pop(output.request_id, None)
                if output.finished
                else self._sinks.get(output.request_id)
            )
        if sink is not None:
            sink(output)

    def _resolve(self, answer: Answer) -> None:
        with self._lock:
            future = self._calls.pop(answer.call_id, None)
            self._submitting.pop(answer.call_id, None)  # accepted (or refused): its outputs go to its sink
        if future is None:
            return  # the caller timed out (or a second answer to one call)
        if isinstance(answer, Refused):
            future.set_exception(RequestError(answer.field, answer.message))
        elif isinstance(answer, Busy):
            future.set_exception(
                EngineOverloaded(f"worker {self.worker_id}: {answer.message}", answer.retry_after_s)
            )
        elif isinstance(answer, CallFailed):
            future.set_exception(RuntimeError(f"worker {self.worker_id}: {answer.message}"))
        else:
            future.set_result(answer)

    def _check_liveness(self) -> None:
        if self._process is not None and not self._process.is_alive():
            self._process.kill()  # what it started, if anything (an external worker's process group) goes too
            self._die(f"process exited with code {self._process.exitcode}")
        elif time.monotonic() - self._last_heard > self._heartbeat_timeout_s:
            self.kill()
            self._die(f"no heartbeat for {self._heartbeat_timeout_s:.1f} s")

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = reason
            # decided once, here: a close() that comes while the outputs below go out (discovery forgetting a
            # worker whose bye this thread is handling) must not turn the rest of them into final errors
            retryable = not self._closing
            sinks, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
            for request_id in self._submitting.values():  # its submit raises WorkerDied: no output as well
                sinks.pop(request_id, None)
        if not (self._closing or self._leaving):
            logger.error("worker %s died: %s; ending %d request(s)", self.worker_id, reason, len(sinks))
        # listeners first: the router must have dropped this worker before its requests are resumed elsewhere
        for listener in self._listeners:
            listener.on_death(self)
        for future in calls.values():
            future.set_exception(WorkerDied(f"worker {self.worker_id} died: {reason}"))
        for request_id, sink in sinks.items():
            sink(
                GenerationOutput(
                    request_id,
                    [],
                    "",
                    finished=True,
                    finish_reason="error",
                    error=f"worker {self.worker_id} died: {reason}",
                    retryable=retryable,
                )
            )


def _wait_for_hello(
    worker_id: WorkerId,
    process: WorkerProcess | None,
    channel: Channel,
    deadline: float,
    event_sink: EventSink | None,
) -> WorkerInfo:
    """The worker's hello; KVBM events it publishes while building its engine go to `event_sink` meanwhile."""
    while True:
        try:
            message = channel.recv(timeout_s=_TICK_S)
            if message is None and process is not None and not process.is_alive():
                message = channel.recv(timeout_s=_TICK_S)  # what it sent just before exiting, if anything
                if message is None:
                    raise WorkerDied(
                        f"worker {worker_id} exited while starting (exit code {process.exitcode})"
                    )
        except BadMessage as exc:
            raise WorkerDied(
                f"worker {worker_id}'s link carried a frame that is not a message: {exc}"
            ) from None
        if message is None and time.monotonic() > deadline:
            raise WorkerDied(f"worker {worker_id} did not start in time")
        if isinstance(message, Hello):
            return message.info
        if isinstance(message, Failed):
            raise WorkerDied(f"worker {worker_id} failed to build its engine: {message.message}")
        if isinstance(message, Event) and event_sink is not None:
            event_sink.publish(message.event)


def spawn_workers(
    worker_ids: Sequence[WorkerId],
    spec: WorkerSpec | ExternalSpec,
    roles: Sequence[str] | None = None,
    envs: Sequence[dict[str, str]] | None = None,
    **options: Any,
) -> list[RemoteEngine]:
    """Start several workers at once (engine loads overlap), each with its role (default: the spec's) and, for
    an ExternalSpec, its own extra environment from `envs`; if one fails, stop the others and raise."""
    specs = [replace_spec(spec, role=role) for role in roles] if roles else [spec] * len(worker_ids)
    if envs is not None:
        specs = [replace_spec(s, env={**s.env, **env}) for s, env in zip(specs, envs, strict=True)]
    with ThreadPoolExecutor(max_workers=len(worker_ids)) as pool:
        futures = [
            pool.submit(RemoteEngine.spawn, worker_id, s, **options)
            for worker_id, s in zip(worker_ids, specs, strict=True)
        ]
        wait(futures)
    failures = [f.exception() for f in futures if f.exception() is not None]
    if failures:
        for future in futures:
            if future.exception() is None:
                future.result().close()
        raise failures[0]  # type: ignore[misc]
    return [future.result() for future in futures]


def replace_spec(spec: WorkerSpec | ExternalSpec, **changes: Any) -> WorkerSpec | ExternalSpec:
    if isinstance(spec, ExternalSpec):
        return msgspec.structs.replace(spec, **changes)
    return dataclasses.replace(spec, **changes)
