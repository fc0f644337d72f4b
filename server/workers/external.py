"""Worker processes under another Python: an engine whose packages cannot share the server's venv (vLLM needs
numpy 2, PyTriton numpy 1) runs in a worker started with that venv's interpreter.

The server starts `<python> -m server.workers.external` with Strata's source on PYTHONPATH and writes one
`ExternalSpec` to its stdin as JSON: which engine (a name in `ENGINES`, not code), its arguments, and the ipc
endpoints of the worker's channel. The child then lives exactly like a spawned worker (`worker.run_worker`: Hello,
heartbeats, the same messages). It exits when the server does: its stdin reaches EOF when the server's process is
gone, even after kill -9. It leads its own process group, which `ChildProcess.kill` ends whole (vLLM's engine core
and its workers are children of it).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from kvbm.events import EventSink
from server import tracing
from server.engine.api import LocalEngine
from server.logs import LogSettings, configure_logging
from server.tracing import TracingSettings
from server.workers.transport import Channel, ChannelAddress

logger = logging.getLogger(__name__)

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding `server`, `kvbm` and `cluster`
# the cores of a worker that the server gave cores of its own ("0,1"): the whole worker process tree runs there
WORKER_CPUS_ENV = "STRATA_WORKER_CPUS"


class ExternalSpec(msgspec.Struct, frozen=True):
    """How a worker under another Python builds its engine: `engine` names a factory of ENGINES, called with
    `config` (JSON values) as keyword arguments."""

    engine: str
    config: dict[str, Any]
    python: str  # the interpreter of the engine's venv
    heartbeat_s: float = 0.5
    forward_events: bool = False
    worker_id: str = "worker-0"
    role: str = "both"
    env: dict[str, str] = msgspec.field(
        default_factory=dict
    )  # set in the worker's environment unless set here
    logs: LogSettings = LogSettings()  # the server's --log-file, --log-format
    tracing: TracingSettings = TracingSettings()  # the server's --otlp-traces-*


class _Launch(msgspec.Struct, frozen=True):
    spec: ExternalSpec
    to_worker: str
    to_server: str


def _vllm(config: dict[str, Any], worker_id: str, events: EventSink | None) -> LocalEngine:
    from server.vllm_engine.engine import build_vllm_engine

    return build_vllm_engine(**config, worker_id=worker_id, events=events)


ENGINES: dict[str, Callable[[dict[str, Any], str, EventSink | None], LocalEngine]] = {"vllm": _vllm}


class ChildProcess:
    """A worker started with `subprocess`, with the few methods of multiprocessing's Process that
    `RemoteEngine` uses."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """SIGKILL the worker and every process it started (its process group)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(spec: ExternalSpec, address: ChannelAddress) -> ChildProcess:
    """Start the worker process; its log goes to this process's stderr."""
    env = {**spec.env, **os.environ}  # the operator's environment wins
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE_ROOT), env.get("PYTHONPATH")) if p)
    popen = subprocess.Popen(
        [spec.python, "-m", "server.workers.external"],
        stdin=subprocess.PIPE, env=env, start_new_session=True,
    )  # fmt: skip
    assert popen.stdin is not None
    popen.stdin.write(msgspec.json.encode(_Launch(spec, address.to_worker, address.to_server)) + b"\n")
    popen.stdin.flush()  # kept open: its EOF tells the child the server is gone
    return ChildProcess(popen)


def pin_to_cpus(value: str | None) -> None:
    """Confine this process, from its one thread, to the cores listed in `value` ("0,1"; None or "": as it is).
    Threads and processes started later inherit the mask: vLLM's engine core and its model worker too.

    vLLM binds only its OpenMP threads (VLLM_CPU_OMP_THREADS_BIND). Its engine core, and its model worker between
    steps, wait for each other by spinning on shared memory (sched_yield, for 1 s after the last message:
    vllm/distributed/device_communicators/shm_broadcast.py). Unbound, one worker's spinner lands on the core
    where another computes, so each worker's whole process tree is bound to its cores (docs/llm.md, "vLLM as the
    engine")."""
    if not value:
        return
    cores = {int(core) for core in value.replace("|", ",").split(",") if core.strip()}
    os.sched_setaffinity(0, cores)


def main() -> None:
    """The child: pin itself to its cores (if the server split them), read the launch line, watch stdin for the
    server's exit, serve the channel."""
    pin_to_cpus(os.environ.get(WORKER_CPUS_ENV))  # first, while this process has one thread
    launch = msgspec.json.decode(sys.stdin.buffer.readline(), type=_Launch)
    spec = launch.spec
    configure_logging(spec.logs, logging.INFO, spec.worker_id)
    tracing.configure_from(spec.tracing, spec.worker_id)
    factory = ENGINES.get(spec.engine)
    if factory is None:
        raise SystemExit(f"unknown engine {spec.engine!r}; known: {', '.join(sorted(ENGINES))}")
    threading.Thread(target=_exit_on_eof, name="parent-watch", daemon=True).start()
    from server.workers.worker import run_worker

    channel = Channel(ChannelAddress(launch.to_worker, launch.to_server), server_side=False)
    run_worker(
        channel,
        lambda events: factory(spec.config, spec.worker_id, events),
        spec.forward_events,
        spec.role,
        spec.heartbeat_s,
    )
    tracing.shutdown()  # export the spans still buffered: os._exit runs no exit handler
    os._exit(0)  # vLLM leaves non-daemon threads behind; its engine core was shut down by engine.close()


def _exit_on_eof() -> None:
    sys.stdin.buffer.read()
    logger.warning("server process is gone; worker exiting")
    os.killpg(0, signal.SIGKILL)  # the whole group: vLLM's engine core and its workers too


if __name__ == "__main__":
    main()
