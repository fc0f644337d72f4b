"""The KVBM service's query port: a ZMQ ROUTER, CURVE server of `service_keys(secret)`, that answers each
`PrefixQuery` from the index on a thread of its own (the protocol: wire.py).

A peer without the cluster secret never completes the CURVE handshake (the ZAP check refuses a peer that knows
the server's public key but not the secret), so not one of its frames reaches the decoder. Each refused
handshake counts in `kvbm_service_auth_failures_total` (the socket's monitor reports them) and is logged, at
most once per `REFUSALS_LOGGED_EVERY_S` with the count since. A frame of an admitted peer that is not a query
(another version) is dropped with a log line and not answered: that client's query times out.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from cluster.curve import CurveKeys, admit_cluster, make_server
from kvbm.index import KVIndex
from kvbm.metrics import KVBMMetrics
from kvbm.wire import MAX_QUERY_BYTES, ZAP_DOMAIN, PrefixAnswer, PrefixQuery

log = logging.getLogger(__name__)

POLL_MS = 100  # how often the thread looks at the stop flag
REFUSALS_LOGGED_EVERY_S = 10.0
_REFUSED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class QueryPort:
    """Bound on `host:port` (0: a port the OS picks) when built; answers from `start` until `stop`. `address` is
    (host, the bound port)."""

    def __init__(self, index: KVIndex, keys: CurveKeys, metrics: KVBMMetrics, host: str, port: int) -> None:
        self.index = index
        self.metrics = metrics
        self._context = zmq.Context()
        self._authenticator = admit_cluster(self._context, keys, ZAP_DOMAIN, "KVBM service query")
        try:
            self._socket = self._bind(keys, host, port)
        except BaseException:
            self._authenticator.stop()
            self._context.destroy(linger=0)
            raise
        self.address = (host, int(self._socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]))
        self._monitor = self._socket.get_monitor_socket(_REFUSED)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(PrefixQuery)
        self._refused_unlogged = 0
        self._refusal_logged_at = -REFUSALS_LOGGED_EVERY_S
        self._stop = threading.Event()
        # both sockets belong to this thread from its start (thread start is the memory barrier ZMQ asks for)
        self._thread = threading.Thread(target=self._serve, name="kvbm-query", daemon=True)

    def _bind(self, keys: CurveKeys, host: str, port: int) -> zmq.Socket:
        sock = self._context.socket(zmq.ROUTER)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_QUERY_BYTES)  # a bigger frame drops its peer unread
        make_server(sock, keys, ZAP_DOMAIN)
        try:
            sock.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError as err:
            sock.close()
            raise OSError(f"kvbm service: cannot bind tcp://{host}:{port}: {err}") from err
        return sock

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop answering and close the port (a query in flight gets no answer)."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()
        else:  # never started: the sockets are still the caller's
            self._close_sockets()
        self._authenticator.stop()
        self._context.term()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                if self._monitor in ready:
                    self._count_refusals()
                if self._socket in ready:
                    self._answer_all()
        except Exception:
            log.exception("kvbm service: the query port stopped; queries go unanswered")
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close()
        self._socket.close()

    def _answer_all(self) -> None:
        """Answer every query waiting: [peer, PrefixQuery] -> [peer, PrefixAnswer]."""
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            query = self._decode(frames)
            if query is None:
                continue
            report = self.index.query(query.block_hashes)
            answer = PrefixAnswer(query.seq, report, self.index.events_applied)
            self._socket.send_multipart([frames[0], self._encoder.encode(answer)])

    def _decode(self, frames: list[bytes]) -> PrefixQuery | None:
        if len(frames) != 2:
            log.warning("kvbm service: dropped a query of %d frames (one expected)", len(frames) - 1)
            return None
        try:
            return self._decoder.decode(frames[1])
        except msgspec.DecodeError as err:  # ValidationError is one: it names the field
            log.warning("kvbm service: dropped a frame that is not a query: %s", err)
            return None

    def _count_refusals(self) -> None:
        while self._monitor.poll(0):
            recv_monitor_message(self._monitor)
            self.metrics.auth_failures.inc()
            self._refused_unlogged += 1
        now = time.monotonic()
        if self._refused_unlogged and now - self._refusal_logged_at >= REFUSALS_LOGGED_EVERY_S:
            log.warning(
                "kvbm service: refused %d connection(s) in the CURVE handshake: no or another cluster secret, "
                "or not a Strata client",
                self._refused_unlogged,
            )
            self._refused_unlogged, self._refusal_logged_at = 0, now
