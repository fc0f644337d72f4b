"""The standalone KVBM service (`strata kvbm`): follows the event Stream into a `KVIndex`, expires dead workers
by their leases, and answers prefix queries over TCP (see wire.py; `KVIndexClient` is the client).

Rebuild after a restart: the service bumps `kvbm:service:epoch` and replays the stream from id 0; workers see the
new epoch on their next heartbeat and re-announce what they hold, which also covers events trimmed from the
stream. A worker whose lease key is gone is removed from the index within `lease_check_s` (O(1), see index.py).
Embedded use (a router in the same process): `KVBMService(redis_url, port=None).start()` and query `.index`.

The query port is authenticated: a connection that does not prove the cluster secret (kvbm.auth's handshake, key
`derive_key(secret, "kvbm-service")`) within `HANDSHAKE_TIMEOUT_S` is closed before any query is read.
"""

from __future__ import annotations

import logging
import signal
import socket
import socketserver
import threading
import time

from prometheus_client import CollectorRegistry, start_http_server

from kvbm.auth import AuthError, server_handshake
from kvbm.channel import EPOCH_KEY, STREAM, agent_lease_key
from kvbm.cli import DEFAULT_PORT
from kvbm.events import TierEvent
from kvbm.index import KVIndex
from kvbm.metrics import KVBMMetrics
from kvbm.redis_link import RedisLink
from kvbm.wire import encode_report, read_query

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 60.0
HANDSHAKE_TIMEOUT_S = 5.0


class KVBMService:
    """Owns the index, a stream-follower thread, a lease-checker thread and (if `port` is set) a TCP server."""

    def __init__(
        self,
        redis_url: str,
        host: str = "127.0.0.1",
        port: int | None = DEFAULT_PORT,
        metrics: KVBMMetrics | None = None,
        lease_check_s: float = 0.5,
        max_workers: int = 64,
        auth_key: bytes | None = None,
    ) -> None:
        """`auth_key` (kvbm.auth.derive_key(secret, "kvbm-service")) is required when `port` is set."""
        if port is not None and auth_key is None:
            raise ValueError("the KVBM service's query port needs the cluster secret (auth_key)")
        self.auth_key = auth_key
        self.metrics = metrics if metrics is not None else KVBMMetrics()
        self.link = RedisLink(redis_url, self.metrics)
        self.index = KVIndex(max_workers=max_workers, metrics=self.metrics)
        self.lease_check_s = lease_check_s
        self.last_id = b"0-0"
        self.address = (host, port)
        self._server: socketserver.ThreadingTCPServer | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> KVBMService:
        self._bump_epoch()
        self._threads = [
            threading.Thread(target=self._follow_loop, name="kvbm-follow", daemon=True),
            threading.Thread(target=self._lease_loop, name="kvbm-leases", daemon=True),
        ]
        if self.address[1] is not None:
            self._server = _QueryServer(self.address, self.index, self.auth_key, self.metrics)
            self.address = self._server.server_address[:2]
            self._threads.append(
                threading.Thread(target=self._server.serve_forever, name="kvbm-query", daemon=True)
            )
        for thread in self._threads:
            thread.start()
        log.info("kvbm service: following %s, queries on %s", self.link.url, self.address)
        return self

    def _bump_epoch(self) -> bool:
        return self.link.call(lambda r: r.set(EPOCH_KEY, b"%d" % time.time_ns()), None) is not None

    def poll_events(self, block_ms: int = 200) -> int:
        """Apply the next batch of stream events (waiting up to `block_ms`); return how many were applied."""
        entries = self.link.call(lambda r: r.xread({STREAM: self.last_id}, count=1000, block=block_ms), None)
        if entries is None:
            self._stop.wait(0.2)  # Redis down: the link backs off; do not spin
            return 0
        applied = 0
        for _, messages in entries:
            for message_id, fields in messages:
                self.last_id = message_id
                try:  # written by anyone on Redis: every field's type and range is checked
                    event = TierEvent.from_fields(fields)
                except ValueError as err:  # names the field (msgspec.ValidationError is one)
                    log.warning(
                        "kvbm service: skipped malformed stream entry %s: %s", message_id.decode(), err
                    )
                    self.metrics.events_rejected.inc()
                    continue
                self.index.apply(event)
                applied += 1
        return applied

    def _follow_loop(self) -> None:
        while not self._stop.is_set():
            self.poll_events()

    def check_leases(self) -> list[str]:
        """Remove workers whose lease expired; return them. Does nothing while Redis is unreachable."""
        workers = self.index.workers

        def alive(r) -> list[int]:
            pipe = r.pipeline(transaction=False)
            for worker_id in workers:
                pipe.exists(agent_lease_key(worker_id))
            pipe.exists(EPOCH_KEY)
            return pipe.execute()

        found = self.link.call(alive, None)
        if found is None:
            return []
        if not found[-1]:
            self._bump_epoch()  # Redis lost its data (restart without persistence): ask workers to re-announce
        dead = [worker_id for worker_id, present in zip(workers, found, strict=False) if not present]
        for worker_id in dead:
            self.index.remove_worker(worker_id)
        return dead

    def _lease_loop(self) -> None:
        last_sweep = time.monotonic()
        while not self._stop.wait(self.lease_check_s):
            if self.check_leases() or time.monotonic() - last_sweep < SWEEP_INTERVAL_S:
                continue
            self.index.sweep()  # reclaim dead workers' bits (O(indexed blocks); queries ignore them already)
            last_sweep = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        self.link.close()


class _QueryHandler(socketserver.BaseRequestHandler):
    server: _QueryServer

    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        index = self.server.index
        try:
            self.request.settimeout(HANDSHAKE_TIMEOUT_S)
            server_handshake(self.request, self.server.auth_key)
            self.request.settimeout(None)
        except (AuthError, OSError) as err:
            log.warning("kvbm service: refused %s: %s", self.client_address, err)
            self.server.metrics.auth_failures.inc()
            return
        while True:
            try:
                block_hashes = read_query(self.request)
            except (ConnectionError, OSError):
                return
            except ValueError as err:
                log.warning("kvbm service: bad query from %s: %s", self.client_address, err)
                return
            self.request.sendall(encode_report(index.query(block_hashes), index.events_applied))


class _QueryServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], index: KVIndex, auth_key: bytes, metrics: KVBMMetrics
    ) -> None:
        self.index = index
        self.auth_key = auth_key
        self.metrics = metrics
        super().__init__(address, _QueryHandler)


def run_service(
    redis_url: str,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    metrics_port: int | None = None,
    registry: CollectorRegistry | None = None,
    lease_check_s: float = 0.5,
    auth_key: bytes | None = None,
) -> None:
    """Run the KVBM service until SIGINT/SIGTERM (the `strata kvbm` command). Metrics on `metrics_port` if set."""
    metrics = KVBMMetrics(registry)
    if metrics_port is not None:
        start_http_server(metrics_port, registry=metrics.registry)
    service = KVBMService(redis_url, host, port, metrics, lease_check_s, auth_key=auth_key).start()
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    stopped.wait()
    service.stop()
