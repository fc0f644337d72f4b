"""`KVIndexClient`: the standalone KVBM service's index, queried over ZMQ CURVE (wire.py) with the same `query` as
`KVIndex`."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import msgspec
import zmq

from cluster.curve import CurveKeys, make_client
from kvbm.block_hash import BlockHash
from kvbm.index import PrefixReport
from kvbm.wire import MAX_ANSWER_BYTES, MAX_QUERY_BLOCKS, PrefixAnswer, PrefixQuery


class KVIndexClient:
    """One DEALER socket to the service at "host:port", a CURVE client of `keys` (`kvbm.wire.service_keys` of the
    cluster secret); thread-safe (one query at a time).

    Each query waits at most `timeout_s` in all, for a connection that passed the handshake and then for its
    answer, and raises TimeoutError after it: a service that is down, unreachable or holds another cluster secret
    costs a query one timeout, never a hang. ZMQ reconnects in the background (every 0.1 s), so a restarted
    service answers the next query; an answer that comes after its query timed out is dropped by its `seq`."""

    def __init__(self, address: str, keys: CurveKeys, timeout_s: float = 2.0) -> None:
        host, _, port = address.rpartition(":")
        self.address = (host or "127.0.0.1", int(port))
        self.timeout_s = timeout_s
        self._context = zmq.Context()
        self._socket = self._connect(keys)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(PrefixAnswer)
        self._lock = threading.Lock()
        self._seq = 0
        self._events_applied = 0

    def _connect(self, keys: CurveKeys) -> zmq.Socket:
        sock = self._context.socket(zmq.DEALER)
        sock.linger = 0
        sock.immediate = True  # a query waits for a connection that passed the handshake, never queues unsent
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_ANSWER_BYTES)
        make_client(sock, keys)
        sock.connect(f"tcp://{self.address[0]}:{self.address[1]}")
        return sock

    @property
    def events_applied(self) -> int:
        """The service index's event count as of the last answered query (0 before the first)."""
        return self._events_applied

    def query(self, block_hashes: Sequence[BlockHash]) -> PrefixReport:
        """Per worker the cumulative leading prefix per tier, and the G4 prefix. Raises TimeoutError (an OSError)
        if no answer came within `timeout_s`, ConnectionError if the answer does not decode, ValueError for a
        query over `MAX_QUERY_BLOCKS`."""
        if len(block_hashes) > MAX_QUERY_BLOCKS:
            raise ValueError(f"a query of {len(block_hashes)} blocks exceeds {MAX_QUERY_BLOCKS}")
        with self._lock:
            deadline = time.monotonic() + self.timeout_s
            self._seq += 1
            self._send(PrefixQuery(self._seq, list(block_hashes)), deadline)
            answer = self._receive(self._seq, deadline)
            self._events_applied = answer.events_applied
            return answer.report

    def _send(self, query: PrefixQuery, deadline: float) -> None:
        if not self._socket.poll(_ms_until(deadline), zmq.POLLOUT):
            raise TimeoutError(self._no_answer("no connection"))
        try:
            self._socket.send(self._encoder.encode(query), zmq.NOBLOCK)
        except zmq.Again:  # the connection dropped since the poll
            raise TimeoutError(self._no_answer("the connection dropped")) from None

    def _receive(self, seq: int, deadline: float) -> PrefixAnswer:
        while self._socket.poll(_ms_until(deadline)):
            frame = self._socket.recv()
            try:
                answer = self._decoder.decode(frame)
            except msgspec.DecodeError as err:
                raise ConnectionError(
                    f"kvbm service {self._where}: an answer that does not decode: {err}"
                ) from err
            if answer.seq == seq:
                return answer
        raise TimeoutError(self._no_answer("no answer"))

    @property
    def _where(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def _no_answer(self, what: str) -> str:
        return (
            f"kvbm service {self._where}: {what} within {self.timeout_s:g} s (not running, unreachable, "
            "or another cluster secret)"
        )

    def close(self) -> None:
        """Idempotent."""
        with self._lock:
            if self._socket.closed:
                return
            self._socket.close()
            self._context.term()


def _ms_until(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))
