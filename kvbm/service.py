"""The standalone KVBM service (`strata kvbm`): follows the event Stream into a `KVIndex`, expires dead workers
by their leases, and answers prefix queries on its query port (query_port.py; `KVIndexClient` is the client).

Rebuild after a restart: the service bumps `kvbm:service:epoch` and replays the stream from id 0; workers see the
new epoch on their next heartbeat and re-announce what they hold, which also covers events trimmed from the
stream. A worker whose lease key is gone is removed from the index within `lease_check_s` (O(1), see index.py).
Embedded use (a router in the same process): `KVBMService(redis_url, port=None).start()` and query `.index`.

The query port is ZMQ CURVE with keys from the cluster secret (`kvbm.wire.service_keys`): a client without the
secret never completes the handshake, and every query and answer is encrypted and authenticated.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from prometheus_client import CollectorRegistry, start_http_server

from cluster.curve import CurveKeys
from cluster.redis_link import RedisLink
from kvbm.channel import EPOCH_KEY, STREAM, agent_lease_key
from kvbm.cli import DEFAULT_PORT
from kvbm.events import TierEvent
from kvbm.index import KVIndex
from kvbm.metrics import KVBMMetrics
from kvbm.query_port import QueryPort

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 60.0


class KVBMService:
    """Owns the index, a stream-follower thread, a lease-checker thread and (if `port` is set) the query port."""

    def __init__(
        self,
        redis_url: str,
        host: str = "127.0.0.1",
        port: int | None = DEFAULT_PORT,
        metrics: KVBMMetrics | None = None,
        lease_check_s: float = 0.5,
        max_workers: int = 64,
        keys: CurveKeys | None = None,
    ) -> None:
        """`keys` (`kvbm.wire.service_keys(cluster secret)`) are required when `port` is set (0: a free port)."""
        if port is not None and keys is None:
            raise ValueError("the KVBM service's query port needs the cluster secret's CURVE keys")
        self.keys = keys
        self.metrics = metrics if metrics is not None else KVBMMetrics()
        self.link = RedisLink(redis_url, self.metrics.redis_up)
        self.index = KVIndex(max_workers=max_workers, metrics=self.metrics)
        self.lease_check_s = lease_check_s
        self.last_id = b"0-0"
        self.address = (host, port)
        self._port: QueryPort | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> KVBMService:
        self._bump_epoch()
        self._threads = [
            threading.Thread(target=self._follow_loop, name="kvbm-follow", daemon=True),
            threading.Thread(target=self._lease_loop, name="kvbm-leases", daemon=True),
        ]
        if self.address[1] is not None:
            self._port = QueryPort(self.index, self.keys, self.metrics, *self.address)
            self.address = self._port.address
            self._port.start()
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
        if self._port is not None:
            self._port.stop()
        for thread in self._threads:
            thread.join(timeout=5)
        self.link.close()


def run_service(
    redis_url: str,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    metrics_port: int | None = None,
    registry: CollectorRegistry | None = None,
    lease_check_s: float = 0.5,
    keys: CurveKeys | None = None,
) -> None:
    """Run the KVBM service until SIGINT/SIGTERM (the `strata kvbm` command). Metrics on `metrics_port` if set."""
    metrics = KVBMMetrics(registry)
    if metrics_port is not None:
        start_http_server(metrics_port, registry=metrics.registry)
    service = KVBMService(redis_url, host, port, metrics, lease_check_s, keys=keys).start()
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    stopped.wait()
    service.stop()
