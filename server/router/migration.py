"""Migration: a request whose worker died is resumed on another worker.

The router resubmits it (each request up to `RouterConfig.migration_limit` times) as the `continuation` of what
the client has seen: the prompt plus the tokens generated so far, and the rest of max_tokens, so a streaming client
sees one uninterrupted answer (counted in `strata_router_migrations_total`). Greedy answers are the same as without
the failure; sampled ones continue from where they were, not as their seed would have gone; text a worker held
back (a partial UTF-8 character, or the tail kept to match a stop string) is lost.
"""

from __future__ import annotations

import logging

from server import tracing
from server.engine.api import GenerationOutput, OutputSink, continuation
from server.router.flight import Flight, Flights, submit_to
from server.router.membership import Membership
from server.router.placement import Unplaced, place
from server.router.router import Router
from server.router.state import RequestState
from server.workers.protocol import WorkerId

logger = logging.getLogger(__name__)


def migrate(
    flight: Flight,
    failed: GenerationOutput,
    sink: OutputSink,
    router: Router,
    workers: Membership,
    flights: Flights,
) -> bool:
    """Resume `flight`, whose worker died (`failed` is its last output), on another worker, with `sink` for its
    outputs. False (the error goes to the client) when it was aborted, has used its migrations or its
    max_tokens, or no worker takes it."""
    request = flight.request
    done = len(flight.output_ids)
    if (
        flight.state not in (RequestState.ROUTED, RequestState.DECODING)
        or flight.migrations >= router.config.migration_limit
        or done >= request.sampling.max_tokens
        or not flight.advance(RequestState.MIGRATING)
    ):
        return False
    resumed = continuation(request, flight.output_ids)
    dead = flight.worker_id  # set in ROUTED and DECODING
    flight.alone = False
    resumed_state = RequestState.ROUTED if flight.first_token_at is None else RequestState.DECODING

    def offer(worker_id: WorkerId) -> None:
        flights.offer(flight, worker_id, resumed_state)
        flight.migrations += 1
        submit_to(workers.serving_worker(worker_id), resumed, sink, flight)

    def withdraw(worker_id: WorkerId, exc: BaseException) -> None:  # it failed at once (dead too, full, ...)
        flight.worker_id, flight.migrations = dead, flight.migrations - 1
        flight.advance(RequestState.MIGRATING)
        logger.warning(
            "request %s: migration to %s failed (%s); trying another", request.request_id, worker_id, exc
        )

    hashes = workers.block_hashes(resumed)
    attributes = {"strata.migration.from": dead or "", "strata.migration.tokens_done": done}
    try:
        with tracing.span("strata.router.migrate", request.trace_context, attributes):
            target = place(
                router,
                request.request_id,
                hashes,
                offer,
                withdraw,
                skip=[dead] if dead else [],
                refusals=(Exception,),
            )
    except Unplaced as exc:  # no worker left to try: the client gets the error
        logger.warning("request %s could not be migrated from %s: %s", request.request_id, dead, exc)
        return False
    router.metrics.migrations.labels(dead).inc()
    logger.warning(
        "request %s migrated from %s to %s after %d tokens (%s)",
        request.request_id,
        dead,
        target,
        done,
        failed.error,
    )
    return True
