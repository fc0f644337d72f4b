"""Remote workers join a served model while it runs: one thread per model follows the registry in Redis.

At start it reads the registered workers, then blocks on the model's join stream (XREAD BLOCK; the block's
timeout, lease_s/3, also paces refreshing this server's claims and removing registrations whose lease expired).
For each free worker: claim it, connect (`RemoteEngine.connect`), and `RoutedEngine.add_worker`. A worker that
dies, hangs or leaves is dropped by whichever comes first: its RemoteEngine's heartbeat timeout, its "bye", or
its lease expiring (seen missing for LEASE_GONE_GRACE_S: a worker that stops says bye on its link, then leaves
the registry, and the link's last outputs must be read before its requests count as lost); new requests go to
the others, and the model keeps serving on its local workers. When it is free again it announces "join" and is
claimed anew.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from server.workers.protocol import WorkerId, WorkerInfo
from server.workers.registry import Directory, WorkerRecord
from server.workers.remote import RemoteEngine, WorkerDied

log = logging.getLogger(__name__)

Connect = Callable[[WorkerRecord, str], RemoteEngine]  # (record, server id) -> an attached RemoteEngine
LEASE_GONE_GRACE_S = 1.0  # a registration missing this long drops its worker (unless its link said bye first)


class WorkerPool(Protocol):
    """Where joining workers go (server.router.routed.RoutedEngine); workers never import the router."""

    def has_live_worker(self, worker_id: WorkerId) -> bool: ...

    def incompatibility(self, model_name: str, info: WorkerInfo) -> str | None: ...

    def add_worker(self, worker: RemoteEngine) -> None: ...


class Discovery:
    def __init__(self, directory: Directory, engine: WorkerPool, connect: Connect) -> None:
        self.directory = directory
        self.engine = engine
        self._connect = connect
        self._remotes: dict[str, RemoteEngine] = {}
        self._refused: set[tuple[str, int]] = set()  # (worker id, pid) of workers that do not fit the model
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"discovery-{directory.model}", daemon=True)

    def start(self) -> Discovery:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following and let go of the remote workers (they stay registered, free for another server)."""
        self._stop.set()
        self._thread.join(timeout=5)
        for worker_id, remote in self._remotes.items():
            remote.close()
            self.directory.release(worker_id)
        self.directory.close()

    def _run(self) -> None:
        period_ms = self.directory.lease_ms // 3
        after = self.directory.stream_tail()
        for record in self.directory.live_records() or []:
            self._attach(record)
        while not self._stop.is_set():
            events = self.directory.wait_for_events(after, block_ms=period_ms)
            if events is None:  # Redis unreachable: keep serving; ask again a period later
                self._stop.wait(period_ms / 1000)
                continue
            for event_id, fields in events:
                after = event_id
                if fields.get("event") == "join":
                    record = self.directory.record(fields["worker"])
                    if record is not None:
                        self._attach(record)
            self._drop_expired()
            self._forget_dead()
            self.directory.keep_claims(list(self._remotes))

    def _attach(self, record: WorkerRecord) -> None:
        """Claim, connect and route to a worker, unless this server has it already, another server does, or it
        does not fit the model (logged once per worker process)."""
        worker_id = record.worker_id
        if self.engine.has_live_worker(WorkerId(worker_id)) or self._stop.is_set():
            return
        problem = self.engine.incompatibility(record.info.model_name, record.info)
        if problem is not None:
            if (worker_id, record.info.pid) not in self._refused:
                self._refused.add((worker_id, record.info.pid))
                log.error("%s: refusing worker %s: %s", self.directory.model, worker_id, problem)
            return
        if not self.directory.claim(worker_id):
            log.info("%s: worker %s is held by another server", self.directory.model, worker_id)
            return
        self._forget(worker_id)
        try:
            remote = self._connect(record, self.directory.server_id)
        except WorkerDied as exc:
            log.warning(
                "%s: could not attach worker %s at %s: %s",
                self.directory.model,
                worker_id,
                record.address.to_worker,
                exc,
            )
            self.directory.release(worker_id)
            return
        self._remotes[worker_id] = remote
        self.engine.add_worker(remote)
        info = remote.info  # logged once requests are routed to it, not when its hello came
        log.info(
            "remote worker %s joined: %s pid %d, model %s; %s",
            worker_id,
            record.address.to_worker,
            info.pid,
            info.model_name,
            info.summary(),
        )

    def _drop_expired(self) -> None:
        """Remove registrations whose lease expired, and stop routing to such a worker even if its heartbeats
        have not timed out yet (the lease can be the first to say a host is gone). A worker found missing is
        dropped only if it still is LEASE_GONE_GRACE_S later and its link has not said bye meanwhile: a worker that
        stops says bye on its link, then deregisters, and its last outputs on the link must be read first."""
        missing = self._missing_alive()
        if missing and not self._stop.wait(LEASE_GONE_GRACE_S):
            for worker_id in missing & self._missing_alive():
                log.warning("%s: worker %s's lease is gone; dropping it", self.directory.model, worker_id)
                self._remotes[worker_id].drop(
                    "its lease is gone"
                )  # its requests are resumed on other workers

    def _missing_alive(self) -> set[str]:
        """Workers this server routes to, alive on their link, whose registration is gone (none while Redis is
        unreachable: heartbeats alone decide then)."""
        live = self.directory.live_records()
        if live is None:
            return set()
        registered = {record.worker_id for record in live}
        return {w for w, remote in self._remotes.items() if remote.alive and w not in registered}

    def _forget_dead(self) -> None:
        """Close the links of remote workers that died and free their claims (a worker that comes back, or
        was only cut off from this server, can then be claimed again)."""
        for worker_id in [w for w, remote in self._remotes.items() if not remote.alive]:
            self._forget(worker_id)
            self.directory.release(worker_id)

    def _forget(self, worker_id: str) -> None:
        remote = self._remotes.pop(worker_id, None)
        if remote is not None:
            remote.close()
