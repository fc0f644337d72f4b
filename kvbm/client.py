"""`KVIndexClient`: the standalone KVBM service's index, queried over TCP with the same `query` as `KVIndex`."""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

from kvbm.auth import client_handshake
from kvbm.block_hash import BlockHash
from kvbm.index import PrefixReport
from kvbm.wire import encode_query, read_report


class KVIndexClient:
    """One persistent connection, reopened once if it broke; thread-safe (one query at a time). Each connection
    first proves the cluster secret (`auth_key`, kvbm.auth.derive_key(secret, "kvbm-service")) and checks the
    service's proof; kvbm.auth.AuthError (an OSError) if either fails."""

    def __init__(self, address: str, auth_key: bytes, timeout_s: float = 2.0) -> None:
        self.auth_key = auth_key
        host, _, port = address.rpartition(":")
        self.address = (host or "127.0.0.1", int(port))
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._events_applied = 0

    @property
    def events_applied(self) -> int:
        """The service index's event count as of the last answered query (0 before the first)."""
        return self._events_applied

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            client_handshake(sock, self.auth_key)
        except OSError:
            sock.close()
            raise
        return sock

    def query(self, block_hashes: Sequence[BlockHash]) -> PrefixReport:
        """Per worker the cumulative leading prefix per tier, and the G4 prefix; raises OSError if unreachable."""
        with self._lock:
            try:
                return self._round_trip(block_hashes)
            except OSError:  # a stale connection (service restarted): reconnect once
                self.close_locked()
                return self._round_trip(block_hashes)

    def _round_trip(self, block_hashes: Sequence[BlockHash]) -> PrefixReport:
        if self._sock is None:
            self._sock = self._connect()
        try:
            self._sock.sendall(encode_query(block_hashes))
            report, self._events_applied = read_report(self._sock)
            return report
        except OSError:
            self.close_locked()
            raise

    def close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()
