"""`place` (server/router/placement.py): route, offer, pass over a worker that refuses, route again; each worker at
most once; the router's count of the request only where it is."""

from __future__ import annotations

import pytest

from kvbm.index import KVIndex
from server.engine.api import EngineOverloaded, EngineUnavailable, RequestId
from server.router.config import RouterConfig
from server.router.placement import Unplaced, place
from server.router.router import Router
from server.workers.protocol import WorkerId, WorkerStats

RID = RequestId("r")


class Workers:
    """Offers recorded in order; a worker named in `refusing` raises its exception instead of taking it."""

    def __init__(self, router: Router, **refusing: BaseException) -> None:
        self.router, self.refusing = router, refusing
        self.offers: list[str] = []
        self.withdrawn: list[tuple[str, BaseException]] = []
        self.held_at_offer: list[int] = []  # requests the router counts, at each offer

    def offer(self, worker_id: WorkerId) -> None:
        self.offers.append(worker_id)
        self.held_at_offer.append(_held(self.router))
        if worker_id in self.refusing:
            raise self.refusing[worker_id]

    def withdraw(self, worker_id: WorkerId, exc: BaseException) -> None:
        self.withdrawn.append((worker_id, exc))


def _router(workers: int = 3) -> Router:
    router = Router(RouterConfig(strategy="round-robin"), KVIndex())
    for i in range(workers):
        router.update_worker(WorkerStats(WorkerId(f"w{i}"), kv_capacity_blocks=100))
    return router


def _held(router: Router) -> int:
    return sum(load.routed_requests for load in router._workers.values())


def test_refusing_workers_are_passed_over_once_each() -> None:
    router = _router()
    full, gone = EngineOverloaded("full", retry_after_s=3.0), EngineUnavailable("gone")
    workers = Workers(router, w0=full, w1=gone)
    chosen = place(router, RID, [], workers.offer, workers.withdraw)
    assert chosen == "w2" and sorted(workers.offers) == ["w0", "w1", "w2"]
    assert [w for w, _ in workers.withdrawn] == [w for w in workers.offers if w != "w2"]
    assert workers.held_at_offer == [1, 1, 1] and _held(router) == 1  # counted only where the request is


def test_no_worker_left_is_unplaced_with_the_reasons_and_nothing_held() -> None:
    router = _router(2)
    full, gone = EngineOverloaded("full", retry_after_s=3.0), EngineUnavailable("gone")
    workers = Workers(router, w0=full, w1=gone)
    with pytest.raises(Unplaced) as unplaced:
        place(router, RID, [], workers.offer, workers.withdraw)
    assert len(workers.offers) == 2 and set(unplaced.value.refusals) == {full, gone}
    assert unplaced.value.overloaded() is full and _held(router) == 0


def test_first_is_offered_without_routing_and_skip_is_never_offered() -> None:
    router = _router()
    router.route(RID, [])  # already routed, e.g. the decode worker chosen at submit
    first = next(w for w, load in router._workers.items() if load.routed_requests)
    workers = Workers(router, **{first: EngineOverloaded("full")})
    others = [w for w in router.workers if w != first]
    place(router, RID, [], workers.offer, workers.withdraw, first=first, skip=[others[0]])
    assert workers.offers == [first, others[1]] and _held(router) == 1


def test_an_error_that_is_not_a_refusal_is_withdrawn_and_raised() -> None:
    router = _router()
    workers = Workers(router, w0=ValueError("bug"), w1=ValueError("bug"), w2=ValueError("bug"))
    with pytest.raises(ValueError):
        place(router, RID, [], workers.offer, workers.withdraw)
    assert len(workers.offers) == 1 and len(workers.withdrawn) == 1
    widened = Workers(router, w0=ValueError("full"), w1=ValueError("full"))
    assert place(router, RID, [], widened.offer, widened.withdraw, refusals=(Exception,)) == "w2"
