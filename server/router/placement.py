"""Placing a request: route, submit, and when the worker refuses, skip it and route again.

Every placement the router makes goes through `place`: a new request, a prefill on a prefill worker, the decode
after it, a migration. The budget is each worker once: a refused worker is excluded from the next route, so a
placement ends after at most as many offers as the router has workers, placed or `Unplaced`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from kvbm.block_hash import BlockHash
from server import tracing
from server.engine.api import EngineOverloaded, EngineUnavailable, RequestId
from server.router.router import NoWorkerError, RouteDecision, Router
from server.workers.protocol import WorkerId

# what a worker raises at submit when it does not take the request: its queue is full, or it is gone (it died
# after its last heartbeat, so the router has not heard yet)
REFUSALS: tuple[type[Exception], ...] = (EngineOverloaded, EngineUnavailable)

Offer = Callable[[WorkerId], None]  # the request's bookkeeping for that worker, then submit to it
Withdraw = Callable[[WorkerId, BaseException], None]  # the offer raised: undo its bookkeeping, say why


class Unplaced(NoWorkerError):
    """No worker took the request: none was left to try after `refusals` (the workers' reasons, in order)."""

    def __init__(self, message: str, refusals: Sequence[Exception]) -> None:
        super().__init__(message)
        self.refusals = list(refusals)

    def overloaded(self) -> EngineOverloaded | None:
        """The last refusal that was a full queue (the caller may retry later), or None."""
        return next((r for r in reversed(self.refusals) if isinstance(r, EngineOverloaded)), None)


def place(
    router: Router,
    request_id: RequestId,
    block_hashes: Sequence[BlockHash],
    offer: Offer,
    withdraw: Withdraw,
    first: WorkerId | None = None,
    skip: Collection[WorkerId] = (),
    refusals: tuple[type[Exception], ...] = REFUSALS,
) -> WorkerId:
    """Offer the request to `first` (already routed), else to the worker `router` picks, until one takes it;
    return that worker. An offer that raises is withdrawn (`withdraw`); a worker that raised one of `refusals` is
    not tried again (nor those in `skip`), anything else propagates. Before each route the router's count of the
    request is released, so it counts only where the request is. Raises Unplaced when no worker is left."""
    tried, reasons = list(skip), []
    worker_id = first
    while True:
        if worker_id is None:
            router.release(request_id)
            try:
                decision = router.route(request_id, block_hashes, exclude=tried)
            except NoWorkerError as exc:
                raise Unplaced(str(exc), reasons) from exc
            worker_id = decision.worker_id
            _trace(decision)
        try:
            offer(worker_id)
            return worker_id
        except BaseException as exc:
            withdraw(worker_id, exc)
            if not isinstance(exc, refusals):
                raise
            reasons.append(exc)
            tried.append(worker_id)
            tracing.add_event(
                "strata.route.refused", {"strata.worker.id": worker_id, "strata.reason": str(exc)}
            )
            worker_id = None


def _trace(decision: RouteDecision) -> None:
    """The decision on the current span (the placement's, server/tracing.py) while tracing."""
    if not tracing.enabled():
        return
    attributes = {
        "strata.worker.id": decision.worker_id,
        "strata.route.strategy": decision.strategy,
        "strata.route.reason": decision.reason,
        "strata.route.blocks": decision.num_blocks,
        "strata.route.overlap_blocks": decision.reusable_blocks,
    }
    if decision.cost is not None:
        attributes["strata.route.cost"] = decision.cost
    tracing.set_attributes(attributes)
