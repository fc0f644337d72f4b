"""Disaggregated serving's flow (the rule deciding where to prefill is disagg.py).

At submit the decode worker is routed as any worker is without disaggregation; when the rule says so, a prefill
worker (the prefill router's pick) takes the request with `RemoteDecode` transfer params (kvbm/transfer_params.py),
prefills, samples the first token and ends with a `KVHandoff` in its last output's params. The client sees that
token at once; then the request goes to the decode worker with the handoff as its params, or to the next best
when that one is gone or refuses (its host's engine reads the
blocks, another host's recomputes them). A prefill worker that dies hands the request to another (each request up
to `RouterConfig.migration_limit` times), else to the decode worker, which prefills it itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import msgspec

from kvbm.block_hash import BlockHash
from kvbm.transfer_params import (
    KVHandoff,
    KVReceived,
    KVTransferParams,
    RemoteDecode,
    decode_transfer_params,
    encode_transfer_params,
)
from server import tracing
from server.engine.api import GenerationOutput, OutputSink, RequestId
from server.router.disagg import DisaggRule
from server.router.flight import Flight, Flights, submit_to
from server.router.membership import Membership
from server.router.metrics import RouterMetrics
from server.router.placement import REFUSALS, Unplaced, place
from server.router.router import RouteDecision, Router
from server.router.state import RequestState
from server.workers.protocol import WorkerId

logger = logging.getLogger(__name__)

DecodeSink = Callable[
    [RequestId, OutputSink], OutputSink
]  # the sink of a decode worker's outputs (RoutedEngine)


class DisaggFlow:
    """Prefill on a prefill worker, then decode on `flight.decode_worker_id`. `queue_depth`: remote prefills in
    flight (requests a prefill worker holds), the rule's queue."""

    def __init__(
        self,
        rule: DisaggRule,
        router: Router,
        prefill_router: Router,
        workers: Membership,
        flights: Flights,
        decode_sink: DecodeSink,
    ) -> None:
        self.rule = rule
        self.router = router
        self.prefill_router = prefill_router
        self.workers = workers
        self.flights = flights
        self._decode_sink = decode_sink
        self.queue_depth = 0
        self._lock = threading.Lock()

    def prefill_remotely(
        self, flight: Flight, decision: RouteDecision, hashes: list[BlockHash], sink: OutputSink
    ) -> bool:
        """Prefill the request on a prefill worker if the rule says so and one takes it (True); False: the caller
        prefills it on `decision`'s worker, the decode worker (counted with the rule's reason)."""
        block_size = self.workers.block_size
        assert block_size is not None  # the first worker gave it (RoutedEngine.submit checks)
        uncached = len(flight.request.prompt_token_ids) - decision.reusable_blocks * block_size
        with self._lock:
            queued = self.queue_depth
        remote, reason = self.rule.decide(uncached, queued, self.workers.live_prefill_workers())
        if remote:
            flight.decode_worker_id = decision.worker_id
            if self._place_prefill(flight, hashes, sink):
                return True
            reason = "prefill_failed"
        self._count(False, reason)
        return False

    def _place_prefill(
        self, flight: Flight, hashes: list[BlockHash], sink: OutputSink, skip: Sequence[WorkerId] = ()
    ) -> bool:
        """Offer the request to the best prefill worker that takes it (not one in `skip`); False if none does."""
        request = flight.request
        decode = self.workers.get(flight.decode_worker_id)
        host = decode.info.hardware.host if decode is not None and decode.info.hardware else ""
        prefill_request = msgspec.structs.replace(
            request, kv_transfer_params=encode_transfer_params(RemoteDecode(host))
        )
        prefill_sink = self._prefill_sink(flight, sink)

        def offer(worker_id: WorkerId) -> None:
            self.flights.offer(flight, worker_id, RequestState.PREFILLING_REMOTE)
            flight.prefill_attempts += 1
            self._queue(+1)
            submit_to(self.workers.serving_worker(worker_id), prefill_request, prefill_sink, flight)

        def withdraw(worker_id: WorkerId, exc: BaseException) -> None:
            self._prefill_done(flight, RequestState.QUEUED)
            if isinstance(exc, REFUSALS):
                logger.info(
                    "request %s: prefill worker %s refused it (%s)", request.request_id, worker_id, exc
                )

        try:
            # under the request's placement when it runs inside it (at submit), else under the request's span
            parent = tracing.current_traceparent() or request.trace_context
            with tracing.span("strata.router.prefill", parent):
                place(self.prefill_router, request.request_id, hashes, offer, withdraw, skip=skip)
        except Unplaced:
            return False
        self._count(True, "long_prompt")
        return True

    def _prefill_sink(self, flight: Flight, sink: OutputSink) -> OutputSink:
        def prefill_sink(output: GenerationOutput) -> None:
            handoff = _handoff_of(output)
            if handoff is not None:  # the first token: show it, then decode where the router chose
                self._handed_off(flight, output, handoff, sink)
            elif output.retryable and flight.state is RequestState.PREFILLING_REMOTE:  # the worker died
                self._prefill_again(flight, sink)
            else:
                if output.finished:  # the first token ended it (or it failed, or was aborted) on the worker
                    self._prefill_done(flight, None)
                    flight.record(output)
                    self.flights.finish(flight.request_id, output)
                sink(output)

        return prefill_sink

    def _handed_off(
        self, flight: Flight, output: GenerationOutput, handoff: KVHandoff, sink: OutputSink
    ) -> None:
        self._prefill_done(flight, RequestState.HANDOFF)
        metrics = self.router.metrics
        if handoff.sent_bytes:
            model = self.workers.model_name
            metrics.kv_transfer_bytes.labels(model, handoff.transport).inc(handoff.sent_bytes)
            metrics.kv_transfer_seconds.labels(model, "send").observe(handoff.sent_us / 1e6)
        shown = msgspec.structs.replace(output, finished=False, kv_transfer_params=None)
        flight.record(shown)
        self.flights.first_token(flight.request_id, shown)
        sink(shown)
        self._decode_after(flight, handoff, sink)

    def _prefill_again(self, flight: Flight, sink: OutputSink) -> None:
        """The prefill worker died: prefill on another, or else on the decode worker."""
        dead = flight.worker_id
        self._prefill_done(flight, RequestState.QUEUED)
        logger.warning("request %s: prefill worker %s died; prefilling it again", flight.request_id, dead)
        if flight.prefill_attempts <= self.router.config.migration_limit:
            try:
                hashes = self.workers.block_hashes(flight.request)
                if self._place_prefill(flight, hashes, sink, skip=[dead] if dead else []):
                    return
            except Exception:
                logger.exception("request %s: prefill retry failed", flight.request_id)
        self._count(False, "prefill_failed")
        self._decode_after(flight, None, sink)

    def _decode_after(self, flight: Flight, handoff: KVHandoff | None, sink: OutputSink) -> None:
        """Continue on the decode worker chosen at submit (from `handoff`, or from scratch), else on the next
        best; the client gets an error only when no decode worker takes it."""
        request = flight.request
        if flight.state is RequestState.ABORTED:  # the client left while the prefill ran
            self.flights.end(flight, sink, "abort", None)
            return
        resumed = (
            request
            if handoff is None
            else msgspec.structs.replace(  # the prefill worker's output had the prompt's logprobs
                request,
                sampling=msgspec.structs.replace(request.sampling, prompt_logprobs=None),
                kv_transfer_params=encode_transfer_params(handoff),
            )
        )
        state, between = (
            (RequestState.ROUTED, RequestState.QUEUED)
            if handoff is None
            else (RequestState.DECODING, RequestState.HANDOFF)
        )
        decode_sink = self._decode_sink(request.request_id, sink)

        def offer(worker_id: WorkerId) -> None:
            self.flights.offer(flight, worker_id, state)
            submit_to(self.workers.serving_worker(worker_id), resumed, decode_sink, flight)

        def withdraw(worker_id: WorkerId, exc: BaseException) -> None:
            flight.advance(between)
            if isinstance(exc, REFUSALS):
                logger.warning(
                    "request %s: decode worker %s refused it (%s)", request.request_id, worker_id, exc
                )

        try:  # the handoff names the prefill worker's host: another host's worker recomputes the prompt
            hashes = self.workers.block_hashes(request)
            attributes = {"strata.kv_handoff": handoff is not None}
            with tracing.span("strata.router.decode", request.trace_context, attributes):
                place(self.router, request.request_id, hashes, offer, withdraw, first=flight.decode_worker_id)
        except Unplaced as exc:
            self.flights.end(flight, sink, "error", f"no decode worker takes it: {exc}")
        except Exception:
            logger.exception("request %s: decode worker %s failed it", request.request_id, flight.worker_id)
            self.flights.end(
                flight,
                sink,
                "error",
                f"internal error placing request {request.request_id}; see the server log",
            )

    def _prefill_done(self, flight: Flight, state: RequestState | None) -> None:
        """The prefill worker is done with the request (handed off, refused, died, finished): out of the queue and
        the prefill router; the request moves to `state` (None: it finishes)."""
        self._queue(-1)
        self.prefill_router.release(flight.request_id)
        if state is not None:
            flight.advance(state)

    def _queue(self, change: int) -> None:
        with self._lock:
            self.queue_depth += change
            depth = self.queue_depth
        self.router.metrics.disagg_prefill_queue.labels(self.workers.model_name).set(depth)

    def _count(self, remote: bool, reason: str) -> None:
        self.router.metrics.disagg_prefills.labels(
            self.workers.model_name, "remote" if remote else "local", reason
        ).inc()


def count_received(metrics: RouterMetrics, model: str, output: GenerationOutput) -> None:
    """strata_disagg_kv_transfer_seconds{side="receive"}: a decode worker's report of the handoff it read."""
    params = _params_of(output)
    if isinstance(params, KVReceived) and params.received_bytes:
        metrics.kv_transfer_seconds.labels(model, "receive").observe(params.received_us / 1e6)


def _handoff_of(output: GenerationOutput) -> KVHandoff | None:
    """The handoff a prefill worker's last output carries, if it handed the request off."""
    params = _params_of(output)
    return params if isinstance(params, KVHandoff) else None


def _params_of(output: GenerationOutput) -> KVTransferParams | None:
    if output.kv_transfer_params is None:
        return None
    try:
        return decode_transfer_params(output.kv_transfer_params)
    except ValueError:
        logger.exception("request %s: unreadable KV transfer params; ignored", output.request_id)
        return None
