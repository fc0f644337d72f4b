"""The driver's side of a sharded worker's ranks: their processes, their heartbeats, their failure and restart.

Rank 0 is the driver and lives in the engine's process; ranks 1..world-1 are child processes
(`python -m server.engine.parallel.rank`, titled `strata <model> worker <i> rank <r>/<world>`), each given a
`RankSpec` on its stdin; the pipe stays open for the rank's life and its EOF ends the rank, so no rank outlives its
driver (even a driver killed with SIGKILL).

A generation of the group:

    spawn ranks -> each loads its part, says Ready -> every rank (driver included) joins the collectives -> steps
                                                         ... until a failure: a rank exits (its pidfd turns readable),
                                                         its heartbeats stop for `heartbeat_timeout_s`, a collective
                                                         times out, or a step raises on the driver

On a failure the monitor thread kills every rank at once (SIGKILL: none is left inside a collective, and the
driver's own pending collective fails at once with a closed connection), records the first cause (a `Failed`
event naming its reason, the rank and its exit signal or code) and reports it; the executor's `recover` then
spawns the next generation (new processes, new store, new sockets).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import msgspec
import torch.distributed as dist
import zmq

from kvbm.config import KVBMConfig
from server.engine.api import RankStats
from server.engine.config import EngineConfig
from server.engine.executor import ExecutorFailure, Failed, FailureReason
from server.engine.parallel import wire
from server.engine.parallel.comm import ShmAllReduce, host_store, segment_path
from server.engine.parallel.plan import ShardPlan
from server.tracing import TracingSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


class RankSpec(msgspec.Struct, frozen=True):
    """What a rank process builds and where it reports: one JSON line on its stdin."""

    engine: EngineConfig
    kvbm: KVBMConfig | None  # its tiers (its part of every block); None: G1 only
    tp_size: int
    pp_size: int
    rank: int
    num_layers: int
    num_blocks: int  # the pool's rows: the same on every rank
    worker_id: str
    title: str
    store_port: int
    control: str  # the ipc endpoint of its PULL (the driver's PUSH binds it)
    replies: str  # the ipc endpoint of the driver's PULL
    num_threads: int
    heartbeat_s: float
    collective_timeout_s: float
    reduce_segment: str = ""  # its stage's shared-memory all-reduce segment ("": gloo's all-reduce)
    tracing: TracingSettings = TracingSettings()  # the driver's (server/tracing.py)

    @property
    def plan(self) -> ShardPlan:
        return ShardPlan(self.tp_size, self.pp_size, self.rank, self.num_layers)

    def encode(self) -> bytes:
        return msgspec.json.encode(self, enc_hook=_to_json)

    @classmethod
    def decode(cls, line: bytes) -> RankSpec:
        return msgspec.json.decode(line, type=cls, dec_hook=_from_json)


def _to_json(value: object) -> object:
    if isinstance(value, Path):  # KVBMConfig.disk_path
        return str(value)
    raise NotImplementedError(f"{type(value).__name__} in a RankSpec")


def _from_json(kind: type, value: object) -> object:
    if kind is Path and isinstance(value, str):
        return Path(value)
    raise NotImplementedError(f"{kind} in a RankSpec")


@dataclass(slots=True)
class GroupSettings:
    """Timing of a group (seconds)."""

    heartbeat_s: float = 0.5  # each rank beats this often
    heartbeat_timeout_s: float = 4.0  # a ready rank silent this long is declared stuck (and killed)
    collective_timeout_s: float = 60.0  # a collective that waits longer raises (a stuck peer)
    start_timeout_s: float = 300.0  # loading weights and joining the group
    answer_timeout_s: float = 10.0  # a KV lookup or onboard asked of every rank


@dataclass(frozen=True, slots=True)
class ShmPlan:
    """Shared-memory all-reduce segments for a group's stages: `slot_floats` per rank (the largest partial sum
    of a step: tokens per step x hidden size), through the compiled kernels."""

    kernels: ModuleType
    tp_size: int
    pp_size: int
    slot_floats: int
    spin: bool  # every rank has cores of its own: waiters spin a little before they sleep


@dataclass(slots=True)
class RankProcess:
    rank: int
    process: subprocess.Popen
    pidfd: int
    ready: bool = False
    last_beat: float = field(default_factory=time.monotonic)
    rss_bytes: int = 0
    busy_s: float = 0.0  # seconds computing, cumulative


def rank_title(model: str, worker_id: str, rank: int, world: int) -> str:
    """`strata <model> worker <i> rank <r>/<world>`: <i> the worker id's trailing number (else the id)."""
    digits = "".join(itertools.takewhile(str.isdigit, reversed(worker_id)))[::-1]
    return f"strata {model} worker {digits or worker_id} rank {rank}/{world}"


def resident_bytes() -> int:
    """This process's resident memory in bytes (/proc/self/statm; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _exited(rank: int, returncode: int) -> Failed:
    """A rank's process ended: on a signal (negative `returncode`) or with an exit code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return Failed(FailureReason.SIGNAL, rank, f"exited on {name}", signal=name)
    return Failed(FailureReason.EXIT_CODE, rank, f"exited with code {returncode}", exit_code=returncode)


class RankGroup:
    """Ranks 1..world-1 of one sharded worker, seen from the driver. `spawn` then `join` (engine thread) start a
    generation; a monitor thread watches it; `send` and `ask` (engine thread) talk to every rank."""

    def __init__(
        self,
        spec: Callable[[int, int, str, str, str], RankSpec],
        world_size: int,
        settings: GroupSettings,
        on_failure: Callable[[Failed], None],
        shm: ShmPlan | None = None,
    ) -> None:
        """`spec(rank, store_port, control_endpoint, replies_endpoint, reduce_segment)`: rank's RankSpec for a
        generation; `on_failure`: called once per failed generation, from whichever thread saw it first; `shm`:
        the stages all-reduce through shared memory (None: through gloo)."""
        self._shm = shm
        self._segments: list[Path] = []
        self.driver_shm: ShmAllReduce | None = None  # the driver's stage's segment, this generation
        self._spec = spec
        self.world_size = world_size
        self.settings = settings
        self._on_failure = on_failure
        self._context = zmq.Context.instance()
        self._lock = threading.Condition()
        self._ranks: dict[int, RankProcess] = {}
        self._answers: dict[int, dict[int, int]] = {}
        self._call_ids = itertools.count(1)
        self.failure: Failed | None = None  # this generation's
        self.last_failure: Failed | None = None  # any generation's latest, kept across restarts
        self._closing = threading.Event()
        self._generation = 0
        self._pushes: dict[int, zmq.Socket] = {}
        self._pull: zmq.Socket | None = None
        self._monitor: threading.Thread | None = None
        self._store: dist.TCPStore | None = None
        self._folder: tempfile.TemporaryDirectory | None = None

    # ---- a generation ----

    def spawn(self) -> None:
        """Start the rank processes of a new generation (they load while the caller does its own work)."""
        self._end_generation()
        self._generation += 1
        self.failure = None
        self._folder = tempfile.TemporaryDirectory(prefix="strata-ranks-")
        folder = Path(self._folder.name)
        self._store = host_store(self.world_size, self.settings.start_timeout_s)
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(f"ipc://{folder / 'replies'}")
        self._create_segments(folder.name)
        for rank in range(1, self.world_size):
            push = self._context.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 100_000)
            push.setsockopt(zmq.LINGER, 0)
            control = f"ipc://{folder / f'rank{rank}'}"
            push.bind(control)
            self._pushes[rank] = push
            segment = str(self._segments[rank // self._shm.tp_size]) if self._segments else ""
            spec = self._spec(rank, self._store.port, control, f"ipc://{folder / 'replies'}", segment)
            self._ranks[rank] = self._launch(spec)
        self._monitor = threading.Thread(
            target=self._watch, args=(self._generation,), name="strata-ranks", daemon=True
        )
        self._monitor.start()

    def _create_segments(self, name: str) -> None:
        """A shared-memory all-reduce segment per stage, laid out; the driver maps its own stage's now."""
        if self._shm is None:
            return
        self._segments = [segment_path(name, stage) for stage in range(self._shm.pp_size)]
        for path in self._segments:
            ShmAllReduce.create(
                self._shm.kernels, path, self._shm.tp_size, self._shm.slot_floats, self._shm.spin
            )
        timeout = self.settings.collective_timeout_s
        self.driver_shm = ShmAllReduce(self._shm.kernels, self._segments[0], 0, timeout)

    def _unlink_segments(self) -> None:
        for path in self._segments:
            path.unlink(missing_ok=True)
        self._segments = []

    def _launch(self, spec: RankSpec) -> RankProcess:
        process = subprocess.Popen(
            [sys.executable, "-m", "server.engine.parallel.rank"],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        assert process.stdin is not None
        process.stdin.write(spec.encode() + b"\n")
        process.stdin.flush()  # the pipe stays open: its EOF tells the rank that the driver is gone
        return RankProcess(spec.rank, process, os.pidfd_open(process.pid))

    def join(self) -> dist.TCPStore:
        """Wait until every rank is Ready (raises ExecutorFailure on a failure, the start timeout or `close`);
        returns the store the driver joins the collectives on."""
        deadline = time.monotonic() + self.settings.start_timeout_s
        with self._lock:
            while not all(r.ready for r in self._ranks.values()):
                if self.failure is not None:
                    raise ExecutorFailure(self.failure)
                if self._closing.is_set():
                    raise ExecutorFailure(Failed(FailureReason.START_FAILED, 0, "the engine is closing"))
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
        if not all(r.ready for r in self._ranks.values()):
            late = [r.rank for r in self._ranks.values() if not r.ready]
            detail = f"not ready within {self.settings.start_timeout_s:.0f} s"
            raise self.fail(Failed(FailureReason.START_FAILED, late[0], detail))
        self._unlink_segments()  # every rank maps its stage's by now: nothing is left behind if they all die
        assert self._store is not None
        return self._store

    def fail(self, failure: Failed) -> ExecutorFailure:
        """Record the generation's first failure, kill every rank, report it; returns the error to raise, of the
        recorded failure (an earlier one if another thread saw the group fail first)."""
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = self.last_failure = failure
            self._kill_all()
            if self.driver_shm is not None:
                self.driver_shm.abort()  # the driver's own wait in an all-reduce fails now
            self._lock.notify_all()
            failure = self.failure
        if first:
            log.error("sharded group failed: %s", failure)
            self._on_failure(failure)
        return ExecutorFailure(failure)

    def step_failed(self, error: BaseException) -> ExecutorFailure:
        """The driver's part of a step raised (a peer's connection reset, a collective's timeout): name the rank
        that caused it when one did (a rank's exit is seen a moment after its closed socket), else the driver."""
        with self._lock:
            self._lock.wait_for(lambda: self.failure is not None, timeout=self.settings.heartbeat_s)
        if self.failure is not None:
            return ExecutorFailure(self.failure)
        for rank in self._ranks.values():
            if rank.process.poll() is not None:
                return self.fail(_exited(rank.rank, rank.process.returncode))
        detail = f"step failed on the driver: {error!r}"[:300]
        return self.fail(Failed(FailureReason.STEP_FAILED, 0, detail))

    def _kill_all(self) -> None:
        for rank in self._ranks.values():
            if rank.process.poll() is None:
                rank.process.kill()

    # ---- talking to the ranks (engine thread) ----

    def send(self, message: wire.ToRank) -> None:
        """The same message to every rank, in order after what was sent before; ExecutorFailure if the group is
        down."""
        if self.failure is not None:
            raise ExecutorFailure(self.failure)
        payload = msgspec.msgpack.encode(message)
        for rank, push in self._pushes.items():
            try:
                push.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                detail = "its control queue is full (it stopped reading)"
                raise self.fail(Failed(FailureReason.STEP_FAILED, rank, detail)) from None

    def ask(self, message: wire.Question, meanwhile: Callable[[], T]) -> tuple[T, list[int]]:
        """Send a question with a fresh call id, run `meanwhile()` (the driver's own part, while the ranks do
        theirs), then wait for every rank's answer; returns what `meanwhile` returned and the answers."""
        call_id = next(self._call_ids)
        message.call_id = call_id
        with self._lock:
            self._answers[call_id] = {}
        self.send(message)
        own = meanwhile()
        deadline = time.monotonic() + self.settings.answer_timeout_s
        with self._lock:
            answers = self._answers[call_id]
            while len(answers) < len(self._pushes) and self.failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            self._answers.pop(call_id, None)
            failure = self.failure
        if failure is not None:
            raise ExecutorFailure(failure)
        if len(answers) < len(self._pushes):
            silent = min(set(self._pushes) - set(answers))
            detail = (f"did not answer a KV {type(message).__name__.lower()} within "
                      f"{self.settings.answer_timeout_s:.0f} s")  # fmt: skip
            raise self.fail(Failed(FailureReason.STEP_FAILED, silent, detail))
        return own, list(answers.values())

    def statuses(self, worker: str) -> list[RankStats]:
        """Every rank of worker `worker`, the driver's own process excluded (the caller adds it)."""
        with self._lock:
            up = self.failure is None
            return [
                RankStats(worker, r.rank, r.process.pid, r.ready and up, r.rss_bytes, r.busy_s)
                for r in self._ranks.values()
            ]

    # ---- the monitor thread ----

    def _watch(self, generation: int) -> None:
        """Read the ranks' replies and watch their processes until the generation ends."""
        pull = self._pull
        assert pull is not None
        decoder = msgspec.msgpack.Decoder(wire.FromRank)
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        pidfds = {r.pidfd: r for r in self._ranks.values()}
        for fd in pidfds:
            poller.register(fd, zmq.POLLIN)
        while generation == self._generation and self.failure is None:
            events = dict(poller.poll(timeout=self.settings.heartbeat_s * 1000))
            for fd, rank in pidfds.items():
                if fd in events:
                    rank.process.wait()
                    if not self._closing.is_set():  # on close the ranks exit as told
                        self.fail(_exited(rank.rank, rank.process.returncode))
                    return
            if pull in events:
                while True:
                    try:
                        frame = pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._receive(decoder.decode(frame))
            self._check_beats()

    def _receive(self, message: wire.FromRank) -> None:
        rank = self._ranks.get(message.rank)
        if rank is None:
            return
        if isinstance(message, wire.Beat):
            rank.last_beat, rank.rss_bytes = time.monotonic(), message.rss_bytes
            rank.busy_s = message.busy_s
        elif isinstance(message, wire.Answer):
            with self._lock:
                answers = self._answers.get(message.call_id)
                if answers is not None:
                    answers[message.rank] = message.value
                    self._lock.notify_all()
        elif isinstance(message, wire.Ready):
            with self._lock:
                rank.ready, rank.last_beat = True, time.monotonic()
                self._lock.notify_all()
        elif isinstance(message, wire.LoadFailed):
            self.fail(Failed(FailureReason.START_FAILED, message.rank, f"failed to load: {message.error}"))

    def _check_beats(self) -> None:
        """A ready rank silent for `heartbeat_timeout_s` is stuck (a loading one is bounded by `start_timeout_s`)."""
        now = time.monotonic()
        for rank in self._ranks.values():
            if rank.ready and now - rank.last_beat > self.settings.heartbeat_timeout_s:
                silent = now - rank.last_beat
                detail = f"no heartbeat for {silent:.1f} s (stuck or stopped)"
                self.fail(Failed(FailureReason.HEARTBEAT, rank.rank, detail))
                return

    # ---- ending ----

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tell every rank to close its tiers and exit; kill those still running after `timeout_s`."""
        self._closing.set()
        if self.failure is None and self._pushes:
            try:
                self.send(wire.Stop())
            except ExecutorFailure:
                pass
        deadline = time.monotonic() + timeout_s
        for rank in self._ranks.values():
            try:
                rank.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank %d did not stop within %.0f s; killed", rank.rank, timeout_s)
        self._end_generation()

    def begin_close(self) -> None:
        """From any thread: a `join` or restart backoff in progress gives up (the engine is closing)."""
        self._closing.set()
        with self._lock:
            self._lock.notify_all()

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    def wait_closing(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for `begin_close`; True once it was called."""
        return self._closing.wait(timeout_s)

    def _end_generation(self) -> None:
        """Kill what is left of the current generation and release its sockets, store and folder."""
        self._generation += 1
        with self._lock:
            self._kill_all()
        for rank in self._ranks.values():
            rank.process.wait()
            if rank.process.stdin is not None:
                rank.process.stdin.close()
            os.close(rank.pidfd)
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join()
        self._monitor = None
        for push in self._pushes.values():
            push.close(0)
        if self._pull is not None:
            self._pull.close(0)
        self._ranks, self._pushes, self._pull, self._store = {}, {}, None, None
        self._unlink_segments()
        self.driver_shm = None
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
