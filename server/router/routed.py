"""`RoutedEngine`: the Engine Protocol over N workers of one model; each request goes where the `Router` says.

The frontend sees one engine. Per request: hash the prompt's full blocks once (`kvbm.block_hash`, the workers'
block size and salt), route, submit to that worker, and release the router's count when the last output
arrives. Worker stats reach the router from heartbeats (`on_beat`); speeds are measured here from the outputs
(prefill tok/s = uncached prompt tokens / time to first token; decode tok/s = output tokens / decode time), only
from requests that had their worker to themselves, so that queueing and batching are not mistaken for a slow
worker (an idle worker would otherwise measure fast, win more traffic, and the skew would feed itself). Each
meter starts from the speeds the worker measured at start (`WorkerInfo.speeds`), so a fast worker is known as
fast from its first request; workers with the same hardware on one host share a meter (`speed_class`).
Workers may join while serving (`add_worker`: remote workers found in Redis, see discovery.py); a model served
by remote workers alone starts with none (requests get `NoWorkerError`, a 503, until one joins) and takes its
block size and salt from the first that joins.

A dead worker leaves the router at once. Its unfinished requests are migrated (each up to
`RouterConfig.migration_limit` times): resubmitted to another worker with the prompt plus the tokens generated so
far and the rest of max_tokens, so a streaming client sees one uninterrupted answer (counted in
`strata_router_migrations_total`). Greedy answers are the same as without the failure; sampled ones continue
from where they were, not as their seed would have gone; text a worker held back (a partial UTF-8 character, or
the tail kept to match a stop string) is lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from kvbm.block_hash import BlockHash, block_hashes, request_salt
from server.engine.api import (
    Engine,
    EngineOverloaded,
    EngineUnavailable,
    GenerationOutput,
    GenerationRequest,
    KVBlockLayout,
    KVHandoff,
    OutputSink,
    PoolStats,
    RemoteDecode,
    RequestId,
    continuation,
    validate_cache_salt,
)
from server.router.disagg import DisaggRule
from server.router.router import NoWorkerError, RouteDecision, Router
from server.router.speed import SpeedMeter, speed_class
from server.workers.protocol import WorkerId, WorkerInfo, WorkerStats
from server.workers.remote import WorkerListener

logger = logging.getLogger(__name__)


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


@dataclass(slots=True)
class _InFlight:
    request: GenerationRequest  # as the client sent it
    worker_id: WorkerId
    submitted_at: float
    alone: bool  # the only request on its worker so far: its timings measure the worker's speed
    first_token_at: float | None = None
    output_ids: list[int] = field(default_factory=list)  # generated so far, on every worker (for migration)
    num_cached_tokens: int | None = None  # as the first worker reported it (what the client was told)
    migrations: int = 0
    aborted: bool = False
    # disaggregated: while `prefilling`, `worker_id` is the prefill worker and the KV goes to `decode_worker_id`
    prefilling: bool = False
    decode_worker_id: WorkerId | None = None
    prefill_attempts: int = 0


class RoutedEngine:
    """Implements `server.engine.api.Engine` over the workers, and `WorkerListener` for each of them."""

    def __init__(
        self,
        workers: Sequence[RoutableWorker],
        router: Router,
        block_size: int | None,
        salt: BlockHash | None,
        model_name: str | None = None,
        max_model_len: int | None = None,
        prefill_router: Router | None = None,
        disagg: DisaggRule | None = None,
    ) -> None:
        """`block_size`/`salt` None: the first worker's (remote-only models); `model_name` and `max_model_len`
        default to the first worker's, and are required without one. `prefill_router` and `disagg`: this model
        takes prefill workers (disaggregated serving, see disagg.py); `router` then routes the decode (and both)
        workers."""
        if (prefill_router is None) != (disagg is None):
            raise ValueError("RoutedEngine: prefill_router and disagg go together")
        if not workers and (model_name is None or max_model_len is None):
            raise ValueError("RoutedEngine without workers needs model_name and max_model_len")
        self.model_name = model_name or workers[0].model_name
        self._max_model_len = max_model_len or min(w.max_model_len for w in workers)
        self.router = router
        self.prefill_router = prefill_router
        self.disagg = disagg
        self.block_size = block_size
        self.salt = salt
        # replaced, never mutated, when a worker joins: readers iterate a snapshot without the lock
        self._workers: dict[WorkerId, RoutableWorker] = {}
        self._speeds: dict[WorkerId, SpeedMeter] = {}  # one meter per speed_class, shared by its workers
        self._meters: dict[Hashable, SpeedMeter] = {}
        self._in_flight: dict[RequestId, _InFlight] = {}
        self._draining: set[WorkerId] = set()  # alive, finishing their requests, taking no new ones
        self._prefill_queue = 0  # remote prefills in flight
        self._lock = threading.Lock()
        self._turn = 0
        for worker in workers:
            self.add_worker(worker)

    def add_worker(self, worker: RoutableWorker) -> None:
        """Route to `worker` from now on (any thread). A worker with the id of one that died replaces it.
        Raises ValueError for a worker of another model or KV layout (its block hashes would not match)."""
        info = worker.info
        with self._lock:
            problem = self.incompatibility(worker.model_name, info)
            if problem is not None:
                raise ValueError(f"worker {worker.worker_id}: {problem}")
            if self.block_size is None:  # the first worker of a remote-only model
                self.block_size, self.salt = (
                    info.block_size,
                    BlockHash(info.salt) if info.salt is not None else None,
                )
            meter = self._meters.setdefault(speed_class(worker.worker_id, info), SpeedMeter())
            meter.seed(info.speeds)
            self._speeds[worker.worker_id] = meter
            self._workers = {**self._workers, worker.worker_id: worker}
            self._draining.discard(worker.worker_id)
        self.router.metrics.show_worker(self.model_name, worker.worker_id, info.hardware)
        for twin in self._workers.values():  # its calibration moved its class's shared meter
            if (
                self._serving(twin) and self._speeds[twin.worker_id] is meter
            ):  # a dead or draining twin must not re-enter the router
                self._router_of(twin).update_worker(self._stats_of(twin))
        self._count_roles()
        worker.add_listener(self)

    def _router_of(self, worker: RoutableWorker) -> Router:
        """The router that balances `worker`: the prefill router for a prefill worker, else the main one."""
        if worker.info.role == "prefill" and self.prefill_router is not None:
            return self.prefill_router
        return self.router

    def _serving(self, worker: RoutableWorker) -> bool:
        """Alive and not draining: the router may send it new requests."""
        return worker.alive and worker.worker_id not in self._draining

    def _count_roles(self) -> None:
        """strata_workers{model,role}: the workers serving (draining ones no longer count)."""
        counts = dict.fromkeys(("prefill", "decode", "both"), 0)
        for worker in self._workers.values():
            if self._serving(worker):
                counts[worker.info.role] = counts.get(worker.info.role, 0) + 1
        for role, count in counts.items():
            self.router.metrics.workers_by_role.labels(self.model_name, role).set(count)

    def _live_prefill_workers(self) -> int:
        return sum(1 for w in self._workers.values() if self._serving(w) and w.info.role == "prefill")

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
        return None

    def has_live_worker(self, worker_id: WorkerId) -> bool:
        worker = self._workers.get(worker_id)
        return worker is not None and worker.alive

    @property
    def max_model_len(self) -> int:
        """The smallest context of the live workers (the configured one while none is live)."""
        return min((w.max_model_len for w in self._workers.values() if w.alive), default=self._max_model_len)

    @property
    def max_tokens_limit(self) -> int:
        """The smallest of the live workers' (the configured context while none is live)."""
        return min(
            (w.max_tokens_limit for w in self._workers.values() if w.alive), default=self._max_model_len
        )

    @property
    def block_layout(self) -> KVBlockLayout | None:
        return (
            KVBlockLayout(self.block_size, self.salt)
            if self.block_size is not None and self.salt is not None
            else None
        )

    def stats(self) -> PoolStats:
        """The live workers' last reports, summed."""
        total = PoolStats(0, 0, 0, 0, 0, 0)
        for worker in self._workers.values():
            if worker.alive:
                pool = worker.stats()
                total.num_blocks += pool.num_blocks
                total.num_free_blocks += pool.num_free_blocks
                total.num_cached_blocks += pool.num_cached_blocks
                total.num_running += pool.num_running
                total.num_waiting += pool.num_waiting
                total.num_preemptions += pool.num_preemptions
        return total

    def encode(self, text: str) -> list[int]:
        return self._on_any_worker(lambda worker: worker.encode(text))

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        return self._on_any_worker(lambda worker: worker.apply_chat_template(messages))

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        if self.block_size is None:
            raise NoWorkerError(f"no worker serves {self.model_name} yet")
        validate_cache_salt(request.cache_salt)
        hashes = self._block_hashes(request)
        if self.disagg is None:
            self._submit_to(request, hashes, sink)
            return
        # the decode worker is routed as any worker is without disaggregation; then where to prefill
        decision = self.router.route(request.request_id, hashes)
        uncached = len(request.prompt_token_ids) - decision.reusable_blocks * self.block_size
        with self._lock:
            queued = self._prefill_queue
        remote, reason = self.disagg.decide(uncached, queued, self._live_prefill_workers())
        if remote:
            flight = self._track(request, decision.worker_id, alone=False)
            flight.decode_worker_id = decision.worker_id
            try:
                if self._prefill_remotely(flight, hashes, sink):
                    return
            except BaseException:
                self._finish(request.request_id)
                raise
            reason = "prefill_failed"
        self._count_prefill(False, reason)
        self._submit_to(request, hashes, sink, decision)

    def _submit_to(
        self,
        request: GenerationRequest,
        hashes: list[BlockHash],
        sink: OutputSink,
        decision: RouteDecision | None = None,
    ) -> None:
        """Submit to the best worker of the main router (`decision`'s, if already routed), else the next best."""
        skip: list[
            WorkerId
        ] = []  # workers that refused it (full queue) or turned out dead: try the next best one
        overloaded: EngineOverloaded | None = None
        while True:
            if decision is None:
                try:
                    decision = self.router.route(request.request_id, hashes, exclude=skip)
                except NoWorkerError:
                    if overloaded is None:
                        raise
                    raise EngineOverloaded(
                        f"{self.model_name}: the wait queue of every worker is full; retry later",
                        overloaded.retry_after_s,
                    ) from None
            worker = self._workers[decision.worker_id]
            self._track(request, decision.worker_id)
            try:
                worker.submit(request, self._sink(request.request_id, sink))
                return
            except EngineOverloaded as exc:
                self._finish(request.request_id)
                self.router.metrics.worker_queue_full.labels(decision.worker_id).inc()
                skip.append(decision.worker_id)
                overloaded = exc
            except EngineUnavailable as exc:  # it died after its last heartbeat: the router has not heard yet
                self._finish(request.request_id)
                logger.warning(
                    "request %s: worker %s is gone (%s); trying another",
                    request.request_id,
                    decision.worker_id,
                    exc,
                )
                skip.append(decision.worker_id)
            except BaseException:
                self._finish(request.request_id)
                raise
            decision = None

    def _track(self, request: GenerationRequest, worker_id: WorkerId, alone: bool = True) -> _InFlight:
        """Start (or restart) the bookkeeping of a request sent to `worker_id`."""
        with self._lock:
            if alone:
                for flight in self._in_flight.values():
                    if flight.worker_id == worker_id:
                        flight.alone = alone = False
            flight = _InFlight(request, worker_id, time.monotonic(), alone)
            self._in_flight[request.request_id] = flight
        return flight

    def _count_prefill(self, remote: bool, reason: str) -> None:
        self.router.metrics.disagg_prefills.labels(
            self.model_name, "remote" if remote else "local", reason
        ).inc()

    # ---- disaggregated serving (disagg.py): prefill on a prefill worker, then decode on flight.decode_worker_id

    def _prefill_remotely(
        self, flight: _InFlight, hashes: list[BlockHash], sink: OutputSink, exclude: Sequence[WorkerId] = ()
    ) -> bool:
        """Send the request to the best prefill worker that takes it (not one in `exclude`); False if none does
        (full or gone)."""
        assert self.prefill_router is not None
        request = flight.request
        decode = self._workers.get(flight.decode_worker_id) if flight.decode_worker_id else None
        host = decode.info.hardware.host if decode is not None and decode.info.hardware else ""
        prefill_request = msgspec.structs.replace(request, remote_decode=RemoteDecode(host))
        skip = list(exclude)
        while True:
            try:
                decision = self.prefill_router.route(request.request_id, hashes, exclude=skip)
            except NoWorkerError:
                return False
            with self._lock:
                flight.worker_id, flight.prefilling = decision.worker_id, True
                flight.prefill_attempts += 1
                self._prefill_queue += 1
            self._show_queue()
            try:
                self._workers[decision.worker_id].submit(prefill_request, self._prefill_sink(flight, sink))
                self._count_prefill(True, "long_prompt")
                return True
            except (EngineOverloaded, EngineUnavailable) as exc:
                logger.info(
                    "request %s: prefill worker %s refused it (%s)",
                    request.request_id,
                    decision.worker_id,
                    exc,
                )
                self._prefill_ended(flight)
                skip.append(decision.worker_id)
            except BaseException:
                self._prefill_ended(flight)
                raise

    def _prefill_ended(self, flight: _InFlight) -> None:
        """The prefill worker is done with the request (handed off, finished, failed): out of the queue."""
        with self._lock:
            if not flight.prefilling:
                return
            flight.prefilling = False
            self._prefill_queue -= 1
        self._show_queue()
        assert self.prefill_router is not None
        self.prefill_router.release(flight.request.request_id)

    def _show_queue(self) -> None:
        self.router.metrics.disagg_prefill_queue.labels(self.model_name).set(self._prefill_queue)

    def _prefill_sink(self, flight: _InFlight, sink: OutputSink) -> OutputSink:
        request_id = flight.request.request_id

        def prefill_sink(output: GenerationOutput) -> None:
            handoff = output.kv_handoff
            if handoff is not None:  # the first token: show it, then decode where the router chose
                self._prefill_ended(flight)
                metrics = self.router.metrics
                if output.kv_transfer_bytes:
                    metrics.kv_transfer_bytes.labels(self.model_name, handoff.transport).inc(
                        output.kv_transfer_bytes
                    )
                    metrics.kv_transfer_seconds.labels(self.model_name, "send").observe(
                        output.kv_transfer_us / 1e6
                    )
                shown = msgspec.structs.replace(
                    output, finished=False, kv_handoff=None, kv_transfer_us=0, kv_transfer_bytes=0
                )
                self._as_sent(flight, shown)
                self._first_token(request_id, shown)
                sink(shown)
                self._decode_after(flight, handoff, sink)
                return
            if (
                output.retryable and not flight.aborted
            ):  # the prefill worker died: prefill elsewhere, or locally
                dead = flight.worker_id
                self._prefill_ended(flight)
                logger.warning("request %s: prefill worker %s died; prefilling it again", request_id, dead)
                if flight.prefill_attempts <= self.router.config.migration_limit and self._retry_prefill(
                    flight, sink, dead
                ):
                    return
                self._count_prefill(False, "prefill_failed")
                self._decode_after(flight, None, sink)
                return
            if (
                output.finished
            ):  # the first token ended it (or it failed, or was aborted) on the prefill worker
                self._prefill_ended(flight)
                self._as_sent(flight, output)
                self._finish(request_id, output)
            sink(output)

        return prefill_sink

    def _retry_prefill(self, flight: _InFlight, sink: OutputSink, dead: WorkerId) -> bool:
        try:
            return self._prefill_remotely(flight, self._block_hashes(flight.request), sink, exclude=[dead])
        except Exception:
            logger.exception("request %s: prefill retry failed", flight.request.request_id)
            return False

    def _decode_after(self, flight: _InFlight, handoff: KVHandoff | None, sink: OutputSink) -> None:
        """Continue on the decode worker chosen at submit (from `handoff`, or from scratch), else on the next
        best; the client gets an error only when no decode worker takes it."""
        request = flight.request
        if flight.aborted:  # the client left while the prefill ran
            self._end(flight, sink, "abort", None)
            return
        resumed = request if handoff is None else msgspec.structs.replace(request, remote_prefill=handoff)
        target, tried = flight.decode_worker_id, []
        while True:
            worker = self._workers.get(target) if target is not None else None
            if worker is not None and self._serving(worker):
                flight.worker_id = target  # before submit: its first output may arrive before submit returns
                try:
                    worker.submit(resumed, self._sink(request.request_id, sink))
                    if flight.aborted:  # the client left while it was being submitted
                        worker.abort(request.request_id)
                    return
                except (EngineOverloaded, EngineUnavailable) as exc:
                    logger.warning(
                        "request %s: decode worker %s refused it (%s)", request.request_id, target, exc
                    )
                except Exception as exc:
                    logger.exception("request %s: decode worker %s failed it", request.request_id, target)
                    self._end(flight, sink, "error", f"{type(exc).__name__}: {exc}")
                    return
            if target is not None:
                tried.append(target)
            self.router.release(request.request_id)
            try:  # the handoff names the prefill worker's host: another host's worker recomputes the prompt
                target = self.router.route(
                    request.request_id, self._block_hashes(request), exclude=tried
                ).worker_id
            except NoWorkerError as exc:
                self._end(flight, sink, "error", f"no decode worker takes it: {exc}")
                return

    def _end(self, flight: _InFlight, sink: OutputSink, reason: str, error: str | None) -> None:
        """Finish a request the router holds between its workers: the client gets the final output."""
        request = flight.request
        output = GenerationOutput(
            request.request_id, [], "", finished=True, finish_reason=reason,  # type: ignore[arg-type]
            num_prompt_tokens=len(request.prompt_token_ids), num_cached_tokens=flight.num_cached_tokens or 0,
            num_output_tokens=len(flight.output_ids), error=error,
        )  # fmt: skip
        self._finish(request.request_id, output)
        sink(output)

    def _block_hashes(self, request: GenerationRequest) -> list[BlockHash]:
        """The prompt's full-block hashes as the worker's engine computes them, from the request's own root (its
        cache salt), so a salted prefix is found only where that salt stored it."""
        return block_hashes(
            request.prompt_token_ids, self.block_size, request_salt(self.salt, request.cache_salt)
        )

    def abort(self, request_id: RequestId) -> None:
        with self._lock:
            flight = self._in_flight.get(request_id)
            if flight is not None:
                flight.aborted = True  # a worker death now ends it instead of migrating it
        if flight is not None:
            self._workers[flight.worker_id].abort(request_id)

    def close(self) -> None:
        """Stop every worker (worker processes exit, remote ones detach); their unfinished requests end. The
        workers stop at the same time: each copies its G2 blocks to its G3 on the way out (kvbm flush)."""
        workers = list(self._workers.values())
        if workers:
            with ThreadPoolExecutor(len(workers), thread_name_prefix="close-worker") as pool:
                list(pool.map(lambda worker: worker.close(), workers))

    def on_beat(self, worker: RoutableWorker) -> None:
        """A worker reported its pool stats: refresh the router's view of it."""
        if self._workers.get(worker.worker_id) is worker and self._serving(worker):
            self._router_of(worker).update_worker(self._stats_of(worker))

    def on_death(self, worker: RoutableWorker) -> None:
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

    def _sink(self, request_id: RequestId, sink: OutputSink) -> OutputSink:
        def routed_sink(output: GenerationOutput) -> None:
            flight = self._in_flight.get(request_id)
            if output.kv_transfer_bytes:  # a decode worker read a prefill worker's handoff
                self.router.metrics.kv_transfer_seconds.labels(self.model_name, "receive").observe(
                    output.kv_transfer_us / 1e6
                )
            if flight is not None:
                if output.retryable and self._migrate(flight, output, routed_sink):
                    return
                self._as_sent(flight, output)
            if output.finished:
                self._finish(request_id, output)
            elif output.new_token_ids:
                self._first_token(request_id, output)
            sink(output)

        return routed_sink

    def _as_sent(self, flight: _InFlight, output: GenerationOutput) -> None:
        """Record the output's tokens; after a migration, restate its counts as the client's request sees them
        (the continuation's prompt holds the tokens generated before)."""
        flight.output_ids.extend(output.new_token_ids)
        if flight.num_cached_tokens is None and (output.new_token_ids or output.finished):
            flight.num_cached_tokens = output.num_cached_tokens
        if flight.migrations and output.num_prompt_tokens >= len(flight.request.prompt_token_ids):
            resumed_at = output.num_prompt_tokens - len(flight.request.prompt_token_ids)
            output.num_prompt_tokens -= resumed_at
            output.num_output_tokens += resumed_at
            output.num_cached_tokens = flight.num_cached_tokens or 0

    def _migrate(self, flight: _InFlight, failed: GenerationOutput, sink: OutputSink) -> bool:
        """Resume a request whose worker died on another worker; False (the error goes to the client) when it was
        aborted, has used its migrations, or no worker takes it."""
        request = flight.request
        done = len(flight.output_ids)
        if (
            flight.aborted
            or flight.migrations >= self.router.config.migration_limit
            or done >= request.sampling.max_tokens
        ):
            return False
        resumed = continuation(request, flight.output_ids)  # same id and cache salt
        dead = flight.worker_id
        hashes = self._block_hashes(resumed)
        tried: list[WorkerId] = [dead]
        while True:
            self.router.release(request.request_id)
            try:
                decision = self.router.route(request.request_id, hashes, exclude=tried)
            except NoWorkerError as exc:  # no worker left to try: the client gets the error
                logger.warning("request %s could not be migrated from %s: %s", request.request_id, dead, exc)
                return False
            # set before submit: the new worker's first output may arrive before submit returns
            flight.worker_id, flight.alone, flight.migrations = (
                decision.worker_id,
                False,
                flight.migrations + 1,
            )
            try:
                self._workers[decision.worker_id].submit(resumed, sink)
                break
            except Exception as exc:  # the new one failed at once (dead too, full): try the next
                flight.worker_id, flight.migrations = dead, flight.migrations - 1
                logger.warning(
                    "request %s: migration to %s failed (%s); trying another",
                    request.request_id,
                    decision.worker_id,
                    exc,
                )
                tried.append(decision.worker_id)
        self.router.metrics.migrations.labels(dead).inc()
        logger.warning(
            "request %s migrated from %s to %s after %d tokens (%s)",
            request.request_id,
            dead,
            decision.worker_id,
            done,
            failed.error,
        )
        return True

    def _first_token(self, request_id: RequestId, output: GenerationOutput) -> None:
        with self._lock:
            flight = self._in_flight.get(request_id)
            if flight is None or flight.first_token_at is not None:
                return
            flight.first_token_at = time.monotonic()
            self.router.prefill_done(request_id)
            if flight.alone:
                self._speeds[flight.worker_id].add_prefill(
                    output.num_prompt_tokens - output.num_cached_tokens,
                    flight.first_token_at - flight.submitted_at,
                )

    def _finish(self, request_id: RequestId, output: GenerationOutput | None = None) -> None:
        if output is not None and output.finish_reason in ("stop", "length"):
            self._first_token(request_id, output)
        with self._lock:
            flight = self._in_flight.pop(request_id, None)
            if (
                flight is not None
                and output is not None
                and flight.first_token_at is not None
                and flight.alone
            ):
                self._speeds[flight.worker_id].add_decode(
                    output.num_output_tokens - 1, time.monotonic() - flight.first_token_at
                )
        self.router.release(request_id)

    @property
    def healthy(self) -> bool:
        """At least one worker that decodes (a decode or aggregated one) is alive and not draining."""
        return any(self._serving(w) and w.info.role != "prefill" for w in self._workers.values())

    def _on_any_worker(self, call: Callable[[RoutableWorker], list[int]]) -> list[int]:
        """`call` on a live worker, in turn (all workers serve the same model); on the next one if that worker
        turns out to be gone."""
        live = [w for w in self._workers.values() if self._serving(w)] or list(self._workers.values())
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

    def _stats_of(self, worker: RoutableWorker) -> WorkerStats:
        pool = worker.stats()
        speed = self._speeds[worker.worker_id]
        self.router.metrics.show_speeds(worker.worker_id, speed.prefill_tok_s, speed.decode_tok_s)
        return WorkerStats(
            worker.worker_id,
            kv_capacity_blocks=pool.num_blocks,
            active_blocks=pool.num_blocks - pool.num_free_blocks,
            in_flight=pool.num_running + pool.num_waiting,
            prefill_tok_s=speed.prefill_tok_s,
            decode_tok_s=speed.decode_tok_s,
        )
