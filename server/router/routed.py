"""`RoutedEngine`: the Engine Protocol over N workers of one model; each request goes where the `Router` says.

The frontend sees one engine. `submit` hashes the prompt's full blocks once (`kvbm.block_hash`, the workers' block
size and salt) and places the request on the cheapest worker that takes it; the outputs then reach the caller's
sink from the workers' threads, the last one with finished=True, and the router's count of the request is released
with it. The jobs behind it, one file each:

    membership.py   the workers: who is in, who serves (alive, not draining), their speeds (speed.py), tokenizing
    flight.py       each request's record and its state (state.py: the states and the moves allowed between them)
    placement.py    route, submit, pass over a worker that refuses, route again: every placement goes through it
    migration.py    a request whose worker died resumes on another from the tokens so far
    disagg_flow.py  disaggregated serving: prefill on a prefill worker, then decode on the decode worker
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbm.block_hash import BlockHash
from server import tracing
from server.engine.api import (
    EngineOverloaded,
    EngineUnavailable,
    GenerationOutput,
    GenerationRequest,
    KVBlockLayout,
    OutputSink,
    PoolStats,
    RequestId,
    validate_cache_salt,
)
from server.router.disagg import DisaggRule
from server.router.disagg_flow import DisaggFlow, count_received
from server.router.flight import Flight, Flights, submit_to
from server.router.membership import Membership, RoutableWorker
from server.router.migration import migrate
from server.router.placement import Unplaced, place
from server.router.router import NoWorkerError, Router
from server.router.state import RequestState
from server.workers.protocol import WorkerId, WorkerInfo

logger = logging.getLogger(__name__)


class RoutedEngine:
    """`server.engine.api.Engine` over the workers of one model.

    Contract: `submit` returns once a worker took the request (its outputs follow on the sink), or raises:
    RequestError for a bad cache salt, NoWorkerError (a 503) while no worker serves the model (a model served by
    remote workers alone, before the first joins), EngineOverloaded when every worker's queue is full. A worker
    that dies mid-request does not end its requests: they migrate (migration.py); only when none can continue a
    request does its sink get the error. `abort` ends a request on whichever worker holds it. Workers may join
    while serving (`add_worker`); `membership` is the `WorkerListener` of each."""

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
        self.disagg = disagg  # the live thresholds (PUT /v1/strata/models/{model}/disagg)
        self.membership = Membership(self.model_name, router, prefill_router, block_size, salt)
        self.flights = Flights(router, self.membership.meter)
        self.disagg_flow = None
        if disagg is not None and prefill_router is not None:
            self.disagg_flow = DisaggFlow(
                disagg, router, prefill_router, self.membership, self.flights, self._sink
            )
        for worker in workers:
            self.add_worker(worker)

    def add_worker(self, worker: RoutableWorker) -> None:
        """Route to `worker` from now on (any thread); see `Membership.add`."""
        self.membership.add(worker)

    def incompatibility(self, model_name: str, info: WorkerInfo) -> str | None:
        return self.membership.incompatibility(model_name, info)

    def has_live_worker(self, worker_id: WorkerId) -> bool:
        worker = self.membership.get(worker_id)
        return worker is not None and worker.alive

    @property
    def block_size(self) -> int | None:
        return self.membership.block_size

    @property
    def salt(self) -> BlockHash | None:
        return self.membership.salt

    @property
    def block_layout(self) -> KVBlockLayout | None:
        return self.membership.block_layout

    @property
    def max_model_len(self) -> int:
        """The smallest context of the live workers (the configured one while none is live)."""
        return min((w.max_model_len for w in self.membership.live()), default=self._max_model_len)

    @property
    def max_tokens_limit(self) -> int:
        """The smallest of the live workers' (the configured context while none is live)."""
        return min((w.max_tokens_limit for w in self.membership.live()), default=self._max_model_len)

    @property
    def healthy(self) -> bool:
        """At least one worker that decodes (a decode or aggregated one) is alive and not draining."""
        return self.membership.decodes()

    def stats(self) -> PoolStats:
        return self.membership.stats()

    def encode(self, text: str) -> list[int]:
        return self.membership.on_any(lambda worker: worker.encode(text))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.membership.on_any(lambda worker: worker.decode(token_ids))

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        return self.membership.on_any(lambda worker: worker.apply_chat_template(messages, tools))

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        if self.membership.block_size is None:
            raise NoWorkerError(f"no worker serves {self.model_name} yet")
        validate_cache_salt(request.cache_salt)
        hashes = self.membership.block_hashes(request)
        flight = self.flights.start(request)
        try:
            with tracing.span(
                "strata.router.place", request.trace_context, {"strata.model": self.model_name}
            ):
                decode_worker = None
                # the decode worker is routed as any is without disaggregation
                if self.disagg_flow is not None:
                    decision = self.router.route(request.request_id, hashes)
                    if self.disagg_flow.prefill_remotely(flight, decision, hashes, sink):
                        return
                    decode_worker = decision.worker_id
                self._place(flight, hashes, sink, decode_worker)
        except BaseException:
            self.flights.finish(request.request_id)
            raise

    def _place(
        self, flight: Flight, hashes: list[BlockHash], sink: OutputSink, first: WorkerId | None
    ) -> None:
        """Submit to the best worker of the main router (`first` if already routed), else the next best."""
        request = flight.request
        routed_sink = self._sink(request.request_id, sink)

        def offer(worker_id: WorkerId) -> None:
            self.flights.offer(flight, worker_id, RequestState.ROUTED, timed=True)
            submit_to(self.membership.serving_worker(worker_id), request, routed_sink, flight)

        def withdraw(worker_id: WorkerId, exc: BaseException) -> None:
            flight.advance(RequestState.QUEUED)
            if isinstance(exc, EngineOverloaded):
                self.router.metrics.worker_queue_full.labels(worker_id).inc()
            elif isinstance(
                exc, EngineUnavailable
            ):  # it died after its last heartbeat: the router has not heard
                logger.warning(
                    "request %s: worker %s is gone (%s); trying another", request.request_id, worker_id, exc
                )

        try:
            place(self.router, request.request_id, hashes, offer, withdraw, first=first)
        except Unplaced as unplaced:
            overloaded = unplaced.overloaded()
            if overloaded is None:
                raise
            raise EngineOverloaded(
                f"{self.model_name}: the wait queue of every worker is full; retry later",
                overloaded.retry_after_s,
            ) from None

    def _sink(self, request_id: RequestId, sink: OutputSink) -> OutputSink:
        """The sink of a worker that decodes the request: record, migrate when the worker died, end, forward."""

        def routed_sink(output: GenerationOutput) -> None:
            flight = self.flights.get(request_id)
            if output.kv_transfer_params is not None:  # a decode worker read a prefill worker's handoff
                count_received(self.router.metrics, self.model_name, output)
            if flight is not None:
                migrated = output.retryable and migrate(
                    flight, output, routed_sink, self.router, self.membership, self.flights
                )
                if migrated:
                    return
                flight.record(output)
            if output.finished:
                self.flights.finish(request_id, output)
            elif output.new_token_ids:
                self.flights.first_token(request_id, output)
            sink(output)

        return routed_sink

    def abort(self, request_id: RequestId) -> None:
        """End the request: ABORTED (it no longer migrates or moves on), then aborted on the worker that holds it,
        whose last output ends it."""
        flight = self.flights.abort(request_id)
        worker = self.membership.get(flight.worker_id) if flight is not None else None
        if worker is not None:
            worker.abort(request_id)

    def close(self) -> None:
        """Stop every worker (worker processes exit, remote ones detach); their unfinished requests end. The
        workers stop at the same time: each copies its G2 blocks to its G3 on the way out (kvbm flush)."""
        workers = self.membership.all()
        if workers:
            with ThreadPoolExecutor(len(workers), thread_name_prefix="close-worker") as pool:
                list(pool.map(lambda worker: worker.close(), workers))
