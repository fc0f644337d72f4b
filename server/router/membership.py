"""The workers of one model behind a `RoutedEngine`: who is in, who serves, and what the routers know of them.

A worker serves while it is alive and not draining; only serving workers are in a router (prefill workers in the
prefill router, the others in the main one). Workers may join while serving (`add`: remote workers found in
Redis, see server/workers/discovery.py); a model served by remote workers alone starts with none and takes its KV
layout (block size, salt) from the first that joins. `Membership` is the `WorkerListener` of every worker: a
dead worker leaves its router at once, a draining one takes nothing new.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar

from kvbm.block_hash import BlockHash, block_hashes, request_salt
from server.engine.api import Engine, EngineUnavailable, GenerationRequest, KVBlockLayout, PoolStats
from server.router.router import NoWorkerError, Router
from server.router.speed import SpeedMeter, speed_class
from server.workers.protocol import WorkerId, WorkerInfo, WorkerStats
from server.workers.remote import WorkerListener

logger = logging.getLogger(__name__)

T = TypeVar("T")
ROLES = ("prefill", "decode", "both")


class RoutableWorker(Engine, Protocol):
    """An engine the router can balance: a `RemoteEngine`, or anything with the same members. Its `stats()` is
    its last report (zeros before the first)."""

    @property
    def worker_id(self) -> WorkerId: ...

    @property
    def info(self) -> WorkerInfo:
        """What the worker said at hello: model, KV layout, hardware, calibrated speeds."""
        ...

    @property
    def alive(self) -> bool: ...

    def add_listener(self, listener: WorkerListener) -> None:
        """Call `listener.on_beat` on each report, `on_rejected` for a frame on its link that is not a message,
        and `on_death` once it is gone."""
        ...


class Membership:
    """The workers of model `model_name`, by id; `block_size`/`salt` None: the first worker's."""

    def __init__(
        self,
        model_name: str,
        router: Router,
        prefill_router: Router | None,
        block_size: int | None,
        salt: BlockHash | None,
    ) -> None:
        self.model_name = model_name
        self.router = router
        self.prefill_router = prefill_router
        self.block_size = block_size
        self.salt = salt
        # replaced, never mutated, when a worker joins: readers iterate a snapshot without the lock
        self._workers: dict[WorkerId, RoutableWorker] = {}
        self._meters: dict[Hashable, SpeedMeter] = {}  # one per speed_class, shared by its workers
        self._meter_of: dict[WorkerId, SpeedMeter] = {}
        self._draining: set[WorkerId] = set()  # alive, finishing their requests, taking no new ones
        self._lock = threading.Lock()
        self._turn = 0

    def add(self, worker: RoutableWorker) -> None:
        """Route to `worker` from now on (any thread). A worker with the id of one that died replaces it.
        Raises ValueError for a worker of another model or KV layout (its block hashes would not match)."""
        info = worker.info
        with self._lock:
            problem = self.incompatibility(worker.model_name, info)
            if problem is not None:
                raise ValueError(f"worker {worker.worker_id}: {problem}")
            if self.block_size is None:  # the first worker of a remote-only model
                self.block_size = info.block_size
                self.salt = BlockHash(info.salt) if info.salt is not None else None
            meter = self._meters.setdefault(speed_class(worker.worker_id, info), SpeedMeter())
            meter.seed(info.speeds)
            self._meter_of[worker.worker_id] = meter
            self._workers = {**self._workers, worker.worker_id: worker}
            self._draining.discard(worker.worker_id)
        self.router.metrics.show_worker(self.model_name, worker.worker_id, info.hardware)
        for twin in self._workers.values():  # its calibration moved its class's shared meter
            if self.serving(twin) and self._meter_of[twin.worker_id] is meter:  # not a dead or draining twin
                self._router_of(twin).update_worker(self._stats_of(twin))
        self._count_roles()
        worker.add_listener(self)

    def incompatibility(self, model_name: str, info: WorkerInfo) -> str | None:
        """Why a worker cannot join this model (another model, another KV layout whose block hashes would not
        match the index, or a prefill worker for a model served aggregated), or None."""
        if model_name != self.model_name:
            return f"serves {model_name!r}, not {self.model_name!r}"
        if info.role == "prefill" and self.prefill_router is None:
            return (
                "is a prefill worker; this model is not served disaggregated (start the server with "
                "--prefill-workers/--decode-workers, or config.pbtxt parameters prefill_workers/decode_workers)"
            )
        if self.block_size is not None and (info.block_size, info.salt) != (self.block_size, self.salt):
            return (
                f"KV layout differs (block size {info.block_size}, salt {info.salt}; this model: "
                f"{self.block_size}, {self.salt}): check dtype and block_size in its model.json"
            )
        others = {w.info.shards for w in self._workers.values()}
        if self.prefill_router is not None and others and others != {info.shards}:
            return (
                f"is sharded {info.shards or 'tp1pp1'}, the model's workers {sorted(s or 'tp1pp1' for s in others)}: "
                "prefill and decode workers hand KV blocks over by rank part, so a disaggregated model's workers "
                "need equal tensor_parallel_size and pipeline_parallel_size"
            )
        return None

    def get(self, worker_id: WorkerId | None) -> RoutableWorker | None:
        return self._workers.get(worker_id) if worker_id is not None else None

    def all(self) -> list[RoutableWorker]:
        return list(self._workers.values())

    def live(self) -> list[RoutableWorker]:
        return [w for w in self._workers.values() if w.alive]

    def serving(self, worker: RoutableWorker) -> bool:
        """Alive and not draining: the router may send it new requests."""
        return worker.alive and worker.worker_id not in self._draining

    def serving_worker(self, worker_id: WorkerId) -> RoutableWorker:
        """The worker `worker_id` if it serves; else EngineUnavailable (a refusal, see placement.py)."""
        worker = self.get(worker_id)
        if worker is None or not self.serving(worker):
            raise EngineUnavailable(f"worker {worker_id} is gone or draining")
        return worker

    def live_prefill_workers(self) -> int:
        return sum(1 for w in self._workers.values() if self.serving(w) and w.info.role == "prefill")

    def decodes(self) -> bool:
        """At least one worker that decodes (a decode or aggregated one) is serving."""
        return any(self.serving(w) and w.info.role != "prefill" for w in self._workers.values())

    def meter(self, worker_id: WorkerId) -> SpeedMeter:
        return self._meter_of[worker_id]

    @property
    def block_layout(self) -> KVBlockLayout | None:
        if self.block_size is None or self.salt is None:
            return None
        return KVBlockLayout(self.block_size, self.salt)

    def block_hashes(self, request: GenerationRequest) -> list[BlockHash]:
        """The prompt's full-block hashes as the workers' engines compute them, from the request's own root (its
        cache salt), so a salted prefix is found only where that salt stored it."""
        if self.block_size is None:
            raise NoWorkerError(f"no worker serves {self.model_name} yet")
        return block_hashes(
            request.prompt_token_ids, self.block_size, request_salt(self.salt, request.cache_salt)
        )

    def stats(self) -> PoolStats:
        """The live workers' last reports, summed."""
        total = PoolStats(0, 0, 0, 0, 0, 0)
        for worker in self.live():
            pool = worker.stats()
            total.num_blocks += pool.num_blocks
            total.num_free_blocks += pool.num_free_blocks
            total.num_cached_blocks += pool.num_cached_blocks
            total.num_running += pool.num_running
            total.num_waiting += pool.num_waiting
            total.num_preemptions += pool.num_preemptions
            total.ranks.extend(pool.ranks)
            for reason, count in pool.restarts.items():
                total.restarts[reason] = total.restarts.get(reason, 0) + count
        return total

    def on_any(self, call: Callable[[RoutableWorker], T]) -> T:
        """`call` on a serving worker, in turn (all workers serve the same model); on the next one if that worker
        turns out to be gone."""
        live = [w for w in self._workers.values() if self.serving(w)] or list(self._workers.values())
        if not live:
            raise NoWorkerError(f"no worker serves {self.model_name} yet")
        self._turn += 1
        for attempt in range(len(live)):
            worker = live[(self._turn + attempt) % len(live)]
            try:
                return call(worker)
            except EngineUnavailable:
                if attempt == len(live) - 1:
                    raise
                logger.warning("worker %s is gone; tokenizing on another", worker.worker_id)
        raise AssertionError("unreachable")

    # ---- WorkerListener

    def on_beat(self, worker: RoutableWorker) -> None:
        """A worker reported its pool stats: refresh the router's view of it."""
        if self._workers.get(worker.worker_id) is worker and self.serving(worker):
            self._router_of(worker).update_worker(self._stats_of(worker))

    def on_death(self, worker: RoutableWorker) -> None:
        """The worker is gone: out of its router (its requests end with retryable errors, then migrate)."""
        if self._workers.get(worker.worker_id) is not worker:
            return  # replaced by a newer worker under the same id
        logger.warning("worker %s left the router", worker.worker_id)
        self._router_of(worker).remove_worker(worker.worker_id)
        self.router.metrics.hide_worker(worker.worker_id)
        self._count_roles()

    def on_draining(self, worker: RoutableWorker) -> None:
        """The worker is stopping (scale-down, SIGTERM): nothing new goes to it; its requests finish there, or
        migrate when it leaves (on_death)."""
        if self._workers.get(worker.worker_id) is not worker:
            return
        logger.info("worker %s is draining: no new requests go to it", worker.worker_id)
        self._draining.add(worker.worker_id)
        self._router_of(worker).remove_worker(worker.worker_id)
        self._count_roles()

    def on_rejected(self, worker: RoutableWorker) -> None:
        """The worker's link carried a frame that is not a message; it is dropped (on_death follows)."""
        self.router.metrics.worker_messages_rejected.labels(worker.worker_id).inc()

    def _router_of(self, worker: RoutableWorker) -> Router:
        """The router that balances `worker`: the prefill router for a prefill worker, else the main one."""
        if worker.info.role == "prefill" and self.prefill_router is not None:
            return self.prefill_router
        return self.router

    def _count_roles(self) -> None:
        """strata_workers{model,role}: the workers serving (draining ones no longer count)."""
        counts = dict.fromkeys(ROLES, 0)
        for worker in self._workers.values():
            if self.serving(worker):
                counts[worker.info.role] = counts.get(worker.info.role, 0) + 1
        for role, count in counts.items():
            self.router.metrics.workers_by_role.labels(self.model_name, role).set(count)

    def _stats_of(self, worker: RoutableWorker) -> WorkerStats:
        pool = worker.stats()
        speed = self._meter_of[worker.worker_id]
        self.router.metrics.show_speeds(worker.worker_id, speed.prefill_tok_s, speed.decode_tok_s)
        return WorkerStats(
            worker.worker_id,
            kv_capacity_blocks=pool.num_blocks,
            active_blocks=pool.num_blocks - pool.num_free_blocks,
            in_flight=pool.num_running + pool.num_waiting,
            prefill_tok_s=speed.prefill_tok_s,
            decode_tok_s=speed.decode_tok_s,
        )
