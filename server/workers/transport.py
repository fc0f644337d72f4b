"""The link between the server and one worker: two ZMQ PUSH/PULL sockets, over unix domain sockets (ipc) for
a worker the server spawned, over TCP for a worker on another host (`strata worker`).

Why ZMQ and not `multiprocessing.Pipe` (bench/worker_transport.py; figures in docs/workers.md): the hot path is
worker -> server, one GenerationOutput per generated token per request, and there this channel carries several
times the Pipe's messages per second for a fraction of the engine thread's time per send: a ZMQ send only queues
the message for ZMQ's I/O thread, so a slow reader never blocks the engine inside its sink (a full Pipe buffer
would). A submit's round trip is about the same on both; it is paid once per request, not per token. Messages are
msgspec structs, smaller and cheaper to encode than pickled tuples.
One socket per direction: ZMQ sockets are not thread-safe, so each process receives on one socket
from one thread and sends on the other under a lock.

Who binds: the side that is found by the other. A spawned worker is told the server's ipc endpoints, so the
server binds; a remote worker advertises its endpoints in Redis, so it binds and servers connect. PUSH
round-robins between connected peers, so a bound worker must have exactly one server connected at a time
(discovery.py takes a claim in Redis before connecting).

Who may connect: a TCP link (a remote worker) is ZMQ CURVE, with keys derived from the cluster secret
(`link_keys`, cluster/curve.py): the worker's sockets are CURVE servers that admit only the one client key the secret
gives, so a peer without the secret never completes the handshake and not one of its frames reaches the
decoder; every frame of an admitted peer is encrypted and authenticated. Why CURVE rather than an HMAC
challenge at hello: a PULL socket fans in every connected peer, so a hello proof would not cover frames that
another connection pushes afterwards; CURVE authenticates each connection in libzmq before it delivers anything.
A spawned worker's ipc sockets are files only their owner may open (0600).

Each frame is one typed message of `protocol.py` (msgpack, decoded by msgspec into the receiving direction's union);
never a pickle. A frame that does not decode, or is over `MAX_MESSAGE_BYTES`, is dropped and `recv` raises
`BadMessage`: the caller logs it, counts it and drops the peer (a server its worker, a worker its server). ZMQ itself
disconnects a peer whose frame is over `_ZMQ_MAX_FACTOR` times the limit before reading it whole (no log line: ZMQ
does not say), so no frame can make a process buffer unbounded memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import uuid
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

from cluster.curve import CurveKeys, admit_cluster, make_client, make_server
from server.workers.protocol import MAX_MESSAGE_BYTES, BadMessage, Codec, Message, ToServer, ToWorker

logger = logging.getLogger(__name__)

_REMOTE_SEND_TIMEOUT_MS = 1000
_ZAP_DOMAIN = b"strata"
_ZMQ_MAX_FACTOR = (
    4  # ZMQ_MAXMSGSIZE = 4 x the checked limit: oversized frames up to it get a log line and a count
)


def link_keys(secret: bytes) -> CurveKeys:
    """The CURVE keys of server <-> worker links: the worker's sockets are the CURVE servers."""
    return CurveKeys.derive(secret, "zmq-curve-worker", "zmq-curve-client")


@dataclass(frozen=True, slots=True)
class ChannelAddress:
    """The two endpoints (ipc:// or tcp://) and which side binds both of them (see the module docstring)."""

    to_worker: str
    to_server: str
    worker_binds: bool = False

    @classmethod
    def fresh(cls) -> ChannelAddress:
        """Fresh ipc endpoints in the temp folder, bound by the server (a worker it spawns)."""
        base = os.path.join(tempfile.gettempdir(), f"strata-{uuid.uuid4().hex[:12]}")
        return cls(f"ipc://{base}-in", f"ipc://{base}-out")

    @classmethod
    def tcp(cls, host: str, port: int) -> ChannelAddress:
        """TCP endpoints bound by the worker: `port` and `port + 1` (0: two ports the OS picks)."""
        if port == 0:
            return cls(f"tcp://{host}:*", f"tcp://{host}:*", worker_binds=True)
        return cls(f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}", worker_binds=True)

    def with_host(self, host: str) -> ChannelAddress:
        """The same TCP ports on another host name (what a worker bound on 0.0.0.0 advertises)."""
        return ChannelAddress(
            _retarget(self.to_worker, host), _retarget(self.to_server, host), self.worker_binds
        )

    def paths(self) -> list[str]:
        """Socket files to remove after use (ipc only)."""
        return [e.removeprefix("ipc://") for e in (self.to_worker, self.to_server) if e.startswith("ipc://")]


def _retarget(endpoint: str, host: str) -> str:
    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://{host}:{port}"


class Channel:
    """One end of the link: `send` from any thread, `recv` from one thread only. `address` is the address as
    bound (wildcard TCP ports resolved) on the binding side, else the one given. Frames over `max_message_bytes`
    are refused both ways. A TCP link needs `curve` (see the module docstring)."""

    def __init__(
        self,
        address: ChannelAddress,
        server_side: bool,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        curve: CurveKeys | None = None,
    ) -> None:
        if address.worker_binds and curve is None:
            raise ValueError(
                "a TCP link to a worker is authenticated: it needs the cluster secret's CURVE keys"
            )
        self._codec = Codec(ToServer if server_side else ToWorker, max_message_bytes)
        self._context = zmq.Context()
        self._authenticator: ThreadAuthenticator | None = None
        self._out = self._context.socket(zmq.PUSH)
        self._in = self._context.socket(zmq.PULL)
        if address.worker_binds:
            self._secure(curve, server_side)
        self._in.setsockopt(zmq.MAXMSGSIZE, _ZMQ_MAX_FACTOR * max_message_bytes)
        # A worker flushes its last messages (a failure report, final outputs) before exiting; the server
        # never waits on a worker that is gone.
        self._out.setsockopt(zmq.LINGER, 0 if server_side else 2000)
        self._in.setsockopt(zmq.LINGER, 0)
        out_endpoint, in_endpoint = (
            (address.to_worker, address.to_server) if server_side else (address.to_server, address.to_worker)
        )
        binds = server_side != address.worker_binds
        if binds:
            # a bound PUSH with no peer blocks in send: bound the wait (the message is dropped instead), so that
            # a worker whose server vanished hangs neither its engine thread nor its heartbeat, and a server
            # whose spawned worker exited never blocks in an Ack while `close` waits for the send lock
            self._out.setsockopt(zmq.SNDTIMEO, _REMOTE_SEND_TIMEOUT_MS)
        if binds:
            self._out.bind(out_endpoint)
            self._in.bind(in_endpoint)
            bound_out = self._out.getsockopt_string(zmq.LAST_ENDPOINT)
            bound_in = self._in.getsockopt_string(zmq.LAST_ENDPOINT)
            to_worker, to_server = (bound_out, bound_in) if server_side else (bound_in, bound_out)
            address = ChannelAddress(to_worker, to_server, address.worker_binds)
        else:
            self._out.connect(out_endpoint)
            self._in.connect(in_endpoint)
        self.address = address
        self._send_lock = threading.Lock()
        self._closed = False
        self._socket_files = address.paths() if binds else []
        for path in self._socket_files:
            os.chmod(path, 0o600)  # a spawned worker's link: no other local user may connect

    def _secure(self, curve: CurveKeys, server_side: bool) -> None:
        """CURVE on both sockets: the worker is the CURVE server (admitting only the cluster's client key), the
        server its client."""
        for sock in (self._out, self._in):
            if server_side:
                make_client(sock, curve)
            else:
                make_server(sock, curve, _ZAP_DOMAIN)
        if not server_side:
            self._authenticator = admit_cluster(self._context, curve, _ZAP_DOMAIN, "worker connection")

    def send(self, message: Message) -> None:
        """Queue a message; dropped once the channel is closed (a worker's engine may still emit outputs for a
        server that has left). Raises BadMessage, sending nothing, for a message over the size limit."""
        with self._send_lock:
            if self._closed:
                return
            frame = self._codec.encode(message)
            try:
                self._out.send(frame)
            except zmq.Again:
                logger.debug(
                    "no server took a %s message within %d ms; dropped",
                    type(message).__name__,
                    _REMOTE_SEND_TIMEOUT_MS,
                )

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """The next message, or None if none came within `timeout_s`. Raises BadMessage for a frame that is not a
        message of this direction (it is dropped; the caller drops the peer)."""
        if timeout_s is not None and not self._in.poll(int(timeout_s * 1000)):
            return None
        frame = self._in.recv()
        if self._in.rcvmore:
            while self._in.rcvmore:
                self._in.recv()
            raise BadMessage("a multipart frame")
        return self._codec.decode(frame)

    def close(self) -> None:
        """Idempotent."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            self._out.close()
        self._in.close()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()
        for path in self._socket_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
