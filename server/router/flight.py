"""The router's record of each request it holds (`Flight`), and the table of them (`Flights`).

A flight is in the table from submit until the client has its last output. Its `state` (state.py) says where the
request is; `worker_id` is the worker it runs on, or is being offered to. The table also turns each request's
timings into its worker's speed (speed.py) and gives the main router back its count when the request ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from server import tracing
from server.engine.api import GenerationOutput, GenerationRequest, OutputSink, RequestId
from server.router.router import Router
from server.router.speed import SpeedMeter
from server.router.state import RequestState, check_transition
from server.workers.protocol import WorkerId

if TYPE_CHECKING:
    from server.router.membership import RoutableWorker


@dataclass(slots=True)
class Flight:
    request: GenerationRequest  # as the client sent it
    state: RequestState = RequestState.QUEUED
    worker_id: WorkerId | None = None  # set before each offer: a worker's first output may beat its submit
    submitted_at: float = 0.0  # monotonic seconds, at the offer to `worker_id`
    alone: bool = False  # the only request on its worker when offered: its timings measure the worker's speed
    first_token_at: float | None = None
    output_ids: list[int] = field(default_factory=list)  # generated so far, on every worker (for migration)
    num_cached_tokens: int | None = None  # as the first worker reported it (what the client was told)
    migrations: int = 0
    decode_worker_id: WorkerId | None = None  # disaggregated: chosen at submit, decodes after the prefill
    prefill_attempts: int = 0  # offers to prefill workers
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def request_id(self) -> RequestId:
        return self.request.request_id

    def move(self, state: RequestState) -> None:
        """Go to `state`; a move `state.TRANSITIONS` does not allow is logged and raised (IllegalTransition)."""
        with self._lock:
            check_transition(self.request_id, self.state, state)
            self.state = state

    def advance(self, state: RequestState) -> bool:
        """`move(state)`, unless the client aborted meanwhile: then the request stays ABORTED (False)."""
        with self._lock:
            if self.state is RequestState.ABORTED:
                return False
            check_transition(self.request_id, self.state, state)
            self.state = state
            return True

    def abort(self) -> None:
        """The client left: ABORTED, unless it already is (or has its last output)."""
        with self._lock:
            if self.state not in (RequestState.ABORTED, RequestState.FINISHED):
                self.state = RequestState.ABORTED

    def record(self, output: GenerationOutput) -> None:
        """Record the output's tokens; after a migration, restate its counts as the client's request sees them
        (the continuation's prompt holds the tokens generated before)."""
        self.output_ids.extend(output.new_token_ids)
        if self.num_cached_tokens is None and (output.new_token_ids or output.finished):
            self.num_cached_tokens = output.num_cached_tokens
        if self.migrations and output.num_prompt_tokens >= len(self.request.prompt_token_ids):
            resumed_at = output.num_prompt_tokens - len(self.request.prompt_token_ids)
            output.num_prompt_tokens -= resumed_at
            output.num_output_tokens += resumed_at
            output.num_cached_tokens = self.num_cached_tokens or 0


class Flights:
    """The flights by request id. `router` is the main router (its count of a request is released when the request
    ends); `meter_of` gives a worker's speed meter."""

    def __init__(self, router: Router, meter_of: Callable[[WorkerId], SpeedMeter]) -> None:
        self._router = router
        self._meter_of = meter_of
        self._flights: dict[RequestId, Flight] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._flights)

    def get(self, request_id: RequestId) -> Flight | None:
        return self._flights.get(request_id)

    def start(self, request: GenerationRequest) -> Flight:
        """A new request, QUEUED (one with the same id is replaced)."""
        flight = Flight(request)
        with self._lock:
            self._flights[request.request_id] = flight
        return flight

    def offer(self, flight: Flight, worker_id: WorkerId, state: RequestState, timed: bool = False) -> None:
        """`flight` goes to `worker_id` in `state` (an aborted one stays ABORTED). `timed`: its timings measure
        the worker's speed if no other request is there (those there stop measuring it)."""
        flight.worker_id = worker_id
        if timed:
            with self._lock:
                flight.submitted_at, flight.alone = time.monotonic(), True
                for other in self._flights.values():
                    if other.worker_id == worker_id and other is not flight:
                        other.alone = flight.alone = False
        flight.advance(state)

    def abort(self, request_id: RequestId) -> Flight | None:
        """The client left: the flight, now ABORTED (a migration or a decode after a prefill no longer starts)."""
        with self._lock:
            flight = self._flights.get(request_id)
            if flight is not None:
                flight.abort()
        return flight

    def first_token(self, request_id: RequestId, output: GenerationOutput) -> None:
        """The request's first token is out (once): its prefill no longer loads its worker; a timed one measures
        the worker's prefill speed."""
        with self._lock:
            flight = self._flights.get(request_id)
            if flight is None or flight.first_token_at is not None:
                return
            flight.first_token_at = time.monotonic()
            if flight.state is RequestState.ROUTED:
                flight.advance(RequestState.DECODING)
            self._router.prefill_done(request_id)
            if flight.alone and flight.worker_id is not None:
                self._meter_of(flight.worker_id).add_prefill(
                    output.num_prompt_tokens - output.num_cached_tokens,
                    flight.first_token_at - flight.submitted_at,
                )

    def finish(self, request_id: RequestId, output: GenerationOutput | None = None) -> None:
        """The client has its last output (`output`; None: the request never reached a worker): out of the
        table, FINISHED, released from the router; a timed one measures its worker's decode speed."""
        if output is not None and output.finish_reason in ("stop", "length"):
            self.first_token(request_id, output)
        with self._lock:
            flight = self._flights.pop(request_id, None)
            if flight is not None:
                flight.move(RequestState.FINISHED)
                if (
                    output is not None
                    and flight.alone
                    and flight.first_token_at is not None
                    and flight.worker_id
                ):
                    self._meter_of(flight.worker_id).add_decode(
                        output.num_output_tokens - 1, time.monotonic() - flight.first_token_at
                    )
        self._router.release(request_id)

    def end(self, flight: Flight, sink: OutputSink, reason: str, error: str | None) -> None:
        """Finish a request the router holds between its workers: the client gets the final output."""
        request = flight.request
        output = GenerationOutput(
            request.request_id, [], "", finished=True, finish_reason=reason,  # type: ignore[arg-type]
            num_prompt_tokens=len(request.prompt_token_ids), num_cached_tokens=flight.num_cached_tokens or 0,
            num_output_tokens=len(flight.output_ids), error=error,
        )  # fmt: skip
        self.finish(request.request_id, output)
        sink(output)


def submit_to(worker: RoutableWorker, request: GenerationRequest, sink: OutputSink, flight: Flight) -> None:
    """Submit `request` (the flight's, or what continues it) to `worker`; if the client aborted meanwhile, abort it
    there too (its last output then ends the flight). A traced request continues the current span (the
    placement's) on the worker."""
    traceparent = tracing.current_traceparent()
    if traceparent is not None:
        request = msgspec.structs.replace(request, trace_context=traceparent)
        tracing.set_attributes({"strata.worker.id": flight.worker_id or ""})
    worker.submit(request, sink)
    if flight.state is RequestState.ABORTED:
        worker.abort(request.request_id)
