"""The link between the server and one worker process: two ZMQ PUSH/PULL sockets over unix domain sockets (ipc).

Why ZMQ and not `multiprocessing.Pipe` (bench/routing.py transport, one pickled GenerationOutput, 2 busy cores):
the hot path is worker -> server, one message per generated token per request, and there ZMQ carries 86k msg/s
against the Pipe's 40k, with 11.5 us of the engine thread spent per send against 24.7 us: a ZMQ send only queues
the message for ZMQ's I/O thread, so a slow reader never blocks the engine inside its sink (a full Pipe buffer
would). A Pipe round trip is shorter (46 us p50 against 78 us), but that is paid once per request (submit), not
per token. One socket per direction: ZMQ sockets are not thread-safe, so each process receives on one socket
from one thread and sends on the other under a lock.

Messages are pickled tuples `(kind, *fields)`; both ends are the same Strata version, spawned by the server.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import zmq


@dataclass(frozen=True, slots=True)
class ChannelAddress:
    """ipc:// endpoints: `to_worker` is bound by the server, `to_server` by the server too (workers connect)."""

    to_worker: str
    to_server: str

    @classmethod
    def fresh(cls) -> ChannelAddress:
        base = os.path.join(tempfile.gettempdir(), f"strata-{uuid.uuid4().hex[:12]}")
        return cls(f"ipc://{base}-in", f"ipc://{base}-out")

    def paths(self) -> list[str]:
        return [self.to_worker.removeprefix("ipc://"), self.to_server.removeprefix("ipc://")]


class Channel:
    """One end of the link: `send` from any thread, `recv` from one thread only."""

    def __init__(self, address: ChannelAddress, server_side: bool) -> None:
        self._context = zmq.Context()
        self._out = self._context.socket(zmq.PUSH)
        self._in = self._context.socket(zmq.PULL)
        # A worker flushes its last messages (a failure report, final outputs) before exiting; the server
        # never waits on a worker that is gone.
        self._out.setsockopt(zmq.LINGER, 0 if server_side else 2000)
        self._in.setsockopt(zmq.LINGER, 0)
        if server_side:
            self._out.bind(address.to_worker)
            self._in.bind(address.to_server)
        else:
            self._out.connect(address.to_server)
            self._in.connect(address.to_worker)
        self._send_lock = threading.Lock()
        self._socket_files = address.paths() if server_side else []

    def send(self, *message: Any) -> None:
        with self._send_lock:
            self._out.send_pyobj(message)

    def recv(self, timeout_s: float | None = None) -> tuple[Any, ...] | None:
        """The next message, or None if none came within `timeout_s`."""
        if timeout_s is not None and not self._in.poll(int(timeout_s * 1000)):
            return None
        return self._in.recv_pyobj()

    def close(self) -> None:
        with self._send_lock:
            self._out.close()
        self._in.close()
        self._context.term()
        for path in self._socket_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
