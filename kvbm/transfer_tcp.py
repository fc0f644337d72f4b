"""Moving one request's prompt KV across hosts: the decode worker pulls it from the prefill worker's socket.

    prefill process                                decode process (kv-fetch thread, then engine thread)
    send: one copy of the rows into a buffer       fetch: DEALER -> [key]
          under a fresh random key                        <- [header, block 0, ..., block n-1]
          -> "tcp://host:port/key"                        (or [b""]: unknown key)
    server thread (ROUTER): answers [key] with     read_into: one memcpy per row out of the received
          the rows, zero-copy, then drops them                frames, released afterwards

Frames: a request is one frame, the key (32 hex digits). The answer is the header, `_HEADER` (magic,
num_blocks, block_bytes, little-endian) followed by the num_blocks u64 block hashes, then one frame per block
(block_bytes each, in order). An unknown key (fetched already, expired, never sent) is answered with one empty
frame, so the fetcher fails at once. Nothing is unpickled: the receiver compares the header byte for byte with
the one it expects; the blocks are raw bytes. One frame per block, not one payload frame: CURVE encrypts each
frame on its own, so a block (737 KB for SmolLM2) stays in cache and the sender's encryption, the wire and the
receiver's decryption overlap (docs/disaggregation.md; bench/kv_transfer.py measures the whole
path).

Why pull: the sender copies the rows once (the engine reuses them as soon as `send` returns) and never waits
on the network; the receiver asks when its fetch thread is free. A receiver that never asks (its request was
aborted, its worker died) costs the sender its buffer for `ttl_s`, swept on each send and by the server
thread. Each handoff is served once, then dropped.

Who may fetch: the link is ZMQ CURVE with keys derived from the cluster secret (`transfer_keys`,
the scheme of every ZMQ link over TCP, cluster/curve.py): the sender's ROUTER is a CURVE server whose ZAP
handler admits only the one client key the secret gives, so a peer without the secret never completes the
handshake and gets no byte of KV; every frame is encrypted and authenticated, both ways. A fetcher with
another secret gets no answer and fails after `fetch_timeout_s`; the handoff stays for one with the right one.

Failures: every way a fetch can go wrong (malformed location, sender gone or unreachable, timeout, unknown
key, another layout, other blocks, a short frame) raises `TransferError`; the decode worker then recomputes
the prompt. ZMQ's MAXMSGSIZE bounds every frame either side reads: a request is a key, an answer's frames are
a header and blocks of the expected sizes (a bigger frame is dropped unread, and the fetch times out).
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import zmq

from cluster.curve import CurveKeys, admit_cluster, make_client, make_server
from cluster.secret import check_secret
from kvbm.transfer import KVSource, TransferError

log = logging.getLogger(__name__)

_MAGIC = b"STRAKVT1"
_HEADER = struct.Struct("<8sQQ")  # magic, num_blocks, block_bytes; then num_blocks u64 hashes
_U64 = 0xFFFF_FFFF_FFFF_FFFF
_KEY_BYTES = 16  # random bytes of a handoff key (32 hex digits on the wire)
_MAX_REQUEST_BYTES = 1024  # the server's MAXMSGSIZE: a key, and CURVE's INITIATE command (~300 B)
_REPLY_SLACK_BYTES = 4096  # over the largest expected frame, in the fetcher's MAXMSGSIZE
_SWEEP_MAX_S = 1.0  # the server thread sweeps expired handoffs at least this often
_ZAP_DOMAIN = b"strata-kv-transfer"
_LOCATION = re.compile(
    r"tcp://(?P<host>[A-Za-z0-9][A-Za-z0-9.-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\])"
    r":(?P<port>[1-9][0-9]{0,4})/(?P<key>[0-9a-f]{32})"  # 32 hex digits: _KEY_BYTES
)
_WILDCARD_HOSTS = {"0.0.0.0", "*", "::", "[::]"}


def transfer_keys(secret: bytes) -> CurveKeys:
    """The CURVE keys of KV handoff links: the senders' sockets are the CURVE servers, every fetcher a client."""
    return CurveKeys.derive(secret, "kv-transfer-curve-server", "kv-transfer-curve-client")


@dataclass(slots=True)
class _Handoff:
    created: float  # time.monotonic() of the send
    header: bytes
    payload: np.ndarray  # (num_blocks, block_bytes) uint8, block-major


def _bracketed(host: str) -> str:
    """An IPv6 address in brackets, as endpoints and locations write it; any other host as it is."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _header(block_hashes: Sequence[int], block_bytes: int) -> bytes:
    hashes = np.array([h & _U64 for h in block_hashes], dtype="<u8")
    return _HEADER.pack(_MAGIC, len(hashes), block_bytes) + hashes.tobytes()


class TcpTransport:
    """Cross-host handoffs served from this process on `bind_host:port` (port 0: a free one the OS picks;
    the bound one is `self.port`), announced in locations as `advertise_host` (default: `bind_host`, or this
    host's name when bound to a wildcard address). `send` and `fetch` may be called from any threads: the
    server socket lives in its own thread, and each fetch opens a socket of its own."""

    name = "tcp"

    def __init__(
        self,
        secret: bytes,
        bind_host: str = "0.0.0.0",
        advertise_host: str | None = None,
        port: int = 0,
        ttl_s: float = 60.0,
        fetch_timeout_s: float = 10.0,
    ) -> None:
        self.keys = transfer_keys(check_secret(secret or b"", "kv transfer (tcp)"))
        self.ttl_s, self.fetch_timeout_s = ttl_s, fetch_timeout_s
        self._handoffs: dict[bytes, _Handoff] = {}  # by key; insertion order is send order
        self._lock = threading.Lock()
        self._closed = False
        self._context = zmq.Context()
        self._authenticator = admit_cluster(self._context, self.keys, _ZAP_DOMAIN, "KV fetch")
        self._wake_endpoint = f"inproc://kv-transfer-wake-{secrets.token_hex(8)}"
        try:
            self._server, self.port = self._bind(bind_host, port)
            self._wake = self._context.socket(zmq.PAIR)
            self._wake.bind(self._wake_endpoint)
        except BaseException:
            self._authenticator.stop()
            self._context.destroy(linger=0)
            raise
        self.advertise_host = _bracketed(
            advertise_host or (socket.gethostname() if bind_host in _WILDCARD_HOSTS else bind_host)
        )
        # both sockets now belong to the server thread (thread start is the memory barrier ZMQ asks for)
        self._thread = threading.Thread(target=self._serve, name="kv-transfer-tcp", daemon=True)
        self._thread.start()

    def _bind(self, bind_host: str, port: int) -> tuple[zmq.Socket, int]:
        server = self._context.socket(zmq.ROUTER)
        server.linger = 0
        server.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
        server.ipv6 = ":" in bind_host  # an IPv6 address
        make_server(server, self.keys, _ZAP_DOMAIN)
        try:
            server.bind(f"tcp://{_bracketed(bind_host)}:{port or '*'}")
        except zmq.ZMQError as err:
            server.close()
            raise OSError(f"kv transfer: cannot bind tcp://{bind_host}:{port}: {err}") from err
        return server, int(server.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])

    @property
    def pending(self) -> int:
        """Handoffs sent and neither fetched nor expired yet."""
        with self._lock:
            return len(self._handoffs)

    def send(self, block_hashes: Sequence[int], blocks: Sequence[np.ndarray]) -> str:
        if len(block_hashes) != len(blocks) or not blocks:
            raise ValueError(f"{len(block_hashes)} block hashes for {len(blocks)} blocks")
        payload = np.stack(blocks).view(np.uint8).reshape(len(blocks), -1)  # the one copy
        handoff = _Handoff(time.monotonic(), _header(block_hashes, payload.shape[1]), payload)
        key = secrets.token_hex(_KEY_BYTES)
        with self._lock:
            if self._closed:
                raise TransferError("the tcp transport is closed")
            self._sweep_locked(handoff.created - self.ttl_s)
            self._handoffs[key.encode()] = handoff
        return f"tcp://{self.advertise_host}:{self.port}/{key}"

    def fetch(self, location: str, block_hashes: Sequence[int], block_bytes: int) -> KVSource:
        match = _LOCATION.fullmatch(location)
        if match is None or int(match["port"]) > 65535:
            raise TransferError(f"not a tcp handoff location: {location!r:.120}")
        where = f"handoff {match['host']}:{match['port']}"
        expected = _header(block_hashes, block_bytes)
        try:
            frames = self._request(match, max(len(expected), block_bytes) + _REPLY_SLACK_BYTES)
        except zmq.ZMQError as err:
            raise TransferError(f"{where}: {err}") from None
        if len(frames) == 1 and len(frames[0]) == 0:
            raise TransferError(
                f"{where}: unknown to its sender (fetched already, expired after its ttl, or never sent)"
            )
        header, blocks = frames[0].bytes, frames[1:]
        if header[: _HEADER.size] != expected[: _HEADER.size] or len(header) != len(expected):
            raise TransferError(f"{where}: another layout or not a handoff")
        if header != expected:
            raise TransferError(f"{where}: holds other blocks")
        if len(blocks) != len(block_hashes) or any(len(block) != block_bytes for block in blocks):
            raise TransferError(f"{where}: {len(blocks)} blocks of other sizes than the header says")
        return _TcpSource(blocks)

    def _request(self, match: re.Match, max_reply_bytes: int) -> list[zmq.Frame]:
        """The sender's answer to one key, within `fetch_timeout_s`, on a socket of this call's own."""
        host = match["host"]
        fetcher = self._context.socket(zmq.DEALER)
        try:
            fetcher.linger = 0
            fetcher.ipv6 = host.startswith("[")
            fetcher.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes)
            make_client(fetcher, self.keys)
            fetcher.connect(f"tcp://{host}:{match['port']}")
            fetcher.send(match["key"].encode(), zmq.NOBLOCK)
            if not fetcher.poll(int(self.fetch_timeout_s * 1000)):
                raise TransferError(
                    f"handoff {host}:{match['port']}: no answer within {self.fetch_timeout_s:g} s (sender "
                    "gone or unreachable, another cluster secret, or an answer over the expected size)"
                )
            return fetcher.recv_multipart(copy=False)
        finally:
            fetcher.close()

    def close(self) -> None:
        """Stop serving and drop every handoff not fetched yet (idempotent). A fetch in flight on another
        thread fails with TransferError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._handoffs.clear()
        waker = self._context.socket(zmq.PAIR)
        waker.linger = 0
        waker.connect(self._wake_endpoint)
        with contextlib.suppress(zmq.Again):  # no peer: the server thread has stopped already
            waker.send(b"", zmq.NOBLOCK)
        waker.close()
        self._thread.join()
        self._authenticator.stop()
        self._context.term()

    # ---- the server thread ----

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._server, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        sweep_ms = max(1, int(min(self.ttl_s / 4, _SWEEP_MAX_S) * 1000))
        try:
            while True:
                ready = dict(poller.poll(sweep_ms))
                if self._wake in ready:
                    return
                if self._server in ready:
                    self._answer_all()
                with self._lock:
                    self._sweep_locked(time.monotonic() - self.ttl_s)
        except Exception:
            log.exception("the kv transfer server stopped; fetches of this process's handoffs will fail")
        finally:
            self._server.close()
            self._wake.close()

    def _answer_all(self) -> None:
        """Answer every request waiting: [peer, key] -> [peer, header, block 0, ...] or [peer, b""]."""
        while True:
            try:
                request = self._server.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer, key = request[0], request[-1]
            with self._lock:
                handoff = self._handoffs.pop(key, None) if len(request) == 2 else None
            if handoff is None:
                self._server.send_multipart([peer, b""])
            else:  # zero-copy: ZMQ holds each row until it is on the wire; our reference goes now
                self._server.send_multipart([peer, handoff.header, *handoff.payload], copy=False)

    def _sweep_locked(self, older_than: float) -> None:
        expired = []
        for key, handoff in self._handoffs.items():
            if handoff.created >= older_than:
                break
            expired.append(key)
        for key in expired:
            del self._handoffs[key]
        if expired:
            log.info("dropped %d kv handoffs never fetched within %g s", len(expired), self.ttl_s)


class _TcpSource:
    """A received handoff: one frame per block, read in place until `release`."""

    def __init__(self, blocks: list[zmq.Frame]) -> None:
        self.num_blocks = len(blocks)
        self._blocks: list[zmq.Frame] | None = blocks

    def read_into(self, first: int, rows: Sequence[np.ndarray]) -> int:
        if self._blocks is None or first >= self.num_blocks:
            return 0
        rows = rows[: self.num_blocks - first]
        for row, block in zip(rows, self._blocks[first:], strict=False):
            np.copyto(row, np.frombuffer(block.buffer, dtype=np.uint8))
        return len(rows)

    def release(self) -> None:
        self._blocks = None
