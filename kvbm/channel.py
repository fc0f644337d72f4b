"""A worker's line to the standalone KVBM service over Redis: tier events on a Stream plus a lease.

Why a Redis Stream (not pub/sub, not a list): events stay in the stream (bounded by MAXLEN ~), so a service that
starts or restarts replays them from id 0 and rebuilds its index; each reader keeps its own offset (the last id it
applied), so several services or routers can follow one stream without coordinating, and a reader that falls
behind catches up instead of losing messages as a pub/sub subscriber would.

Keys (all on the Redis of `--redis-url`):
    kvbm:events            stream of TierEvent field maps (see events.py)
    kvbm:lease:<worker>    exists while the worker lives: SET PX ttl, refreshed every ttl/3 by a heartbeat thread
    kvbm:service:epoch     bumped by each service start; a worker that sees it change re-announces its blocks
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from cluster.redis_link import RedisLink
from kvbm.events import TierEvent

log = logging.getLogger(__name__)

STREAM = b"kvbm:events"
LEASE_PREFIX = b"kvbm:lease:"
EPOCH_KEY = b"kvbm:service:epoch"
STREAM_MAXLEN = 1_000_000  # events (each carries a batch of hashes)


def agent_lease_key(worker_id: str) -> bytes:
    """A KVBM agent's liveness key for the service (not a worker registration's: server.workers.registry)."""
    return LEASE_PREFIX + worker_id.encode()


def coalesce(events: list[TierEvent]) -> list[TierEvent]:
    """Merge runs of events that differ only in their hashes (e.g. one BlockStored per block) into one event."""
    merged: list[TierEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if last is not None and _same_kind(last, event):
            merged[-1] = replace(last, block_hashes=last.block_hashes + event.block_hashes)
        else:
            merged.append(event)
    return merged


def _same_kind(a: TierEvent, b: TierEvent) -> bool:
    return (a.worker_id, a.kind, a.tier, a.from_tier, a.ttl_s) == (
        b.worker_id,
        b.kind,
        b.tier,
        b.from_tier,
        b.ttl_s,
    )


class RedisWorkerChannel:
    """EventSink that batches events into XADD pipelines (one flush per `flush_s`) and keeps the worker's lease.

    `on_resync` (set by the owner, e.g. `KVBMConnector.announce`) runs on the heartbeat thread when the service
    epoch changes or Redis comes back after an outage: events published meanwhile were lost, so the worker
    announces everything it holds again. Redis down: events are dropped (counted in the log), never raised.
    """

    def __init__(
        self, link: RedisLink, worker_id: str, lease_ttl_s: float = 3.0, flush_s: float = 0.01
    ) -> None:
        self.link = link
        self.worker_id = worker_id
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.flush_s = flush_s
        self.on_resync: Callable[[], None] | None = None
        self._pending: list[TierEvent] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._epoch: bytes | None = None
        self._was_down = False
        self._heartbeat()
        self._threads = [
            threading.Thread(target=self._flush_loop, name=f"kvbm-events-{worker_id}", daemon=True),
            threading.Thread(target=self._lease_loop, name=f"kvbm-lease-{worker_id}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def publish(self, event: TierEvent) -> None:
        with self._lock:
            self._pending.append(event)
        self._wake.set()

    def flush(self) -> int:
        """Send pending events now; return how many were sent (0 if Redis is down: they are dropped)."""
        with self._lock:
            events, self._pending = coalesce(self._pending), []
        if not events:
            return 0

        def send(r) -> int:
            pipe = r.pipeline(transaction=False)
            for event in events:
                pipe.xadd(STREAM, event.to_fields(), maxlen=STREAM_MAXLEN, approximate=True)
            pipe.execute()
            return len(events)

        sent = self.link.call(send, 0)
        if not sent:
            self._was_down = True
            log.debug("kvbm: dropped %d events while Redis is unreachable", len(events))
        return sent

    def _flush_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            self._stop.wait(self.flush_s)  # gather a batch
            self.flush()

    def _heartbeat(self) -> bool:
        """Refresh the lease; return True if the worker must re-announce (new epoch or Redis came back)."""

        def beat(r) -> bytes | None:
            pipe = r.pipeline(transaction=False)
            pipe.set(agent_lease_key(self.worker_id), b"1", px=self.lease_ttl_ms)
            pipe.get(EPOCH_KEY)
            return pipe.execute()[1] or b""

        epoch = self.link.call(beat, None)
        if epoch is None:
            self._was_down = True
            return False
        resync = self._was_down or (self._epoch is not None and epoch != self._epoch)
        self._epoch, self._was_down = epoch, False
        return resync

    def _lease_loop(self) -> None:
        while not self._stop.wait(self.lease_ttl_ms / 3000):
            if self._heartbeat() and self.on_resync is not None:
                log.info("kvbm %s: service restarted or Redis returned; re-announcing blocks", self.worker_id)
                self.on_resync()

    def close(self) -> None:
        """Flush, drop the lease (the service forgets this worker at once) and stop the threads."""
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=2)
        self.flush()
        self.link.call(lambda r: r.delete(agent_lease_key(self.worker_id)), 0)
