"""The router's behaviours, over the real KVBM index (`kvbm.index.KVIndex`) fed with tier events."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence

import pytest

from kvbm.block_hash import BlockHash, block_hashes, model_salt
from kvbm.events import G1, G3, G4, TierEvent
from kvbm.index import KVIndex, PrefixReport
from server.router.config import RouterConfig
from server.router.router import NoWorkerError, Router
from server.workers.protocol import WorkerId, WorkerStats

SALT = model_salt("test-model")
BLOCK = 16


def hashes(*segments: tuple[int, int]) -> list[BlockHash]:
    """Block hashes of a prompt made of (token, num_blocks) runs: equal leading runs share a prefix."""
    tokens = [token for token, blocks in segments for _ in range(blocks * BLOCK)]
    return block_hashes(tokens, BLOCK, SALT)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_router(workers: int = 4, capacity: int = 10_000, **config: object) -> tuple[Router, KVIndex]:
    index = KVIndex()
    router = Router(RouterConfig(**config), index)  # type: ignore[arg-type]
    for i in range(workers):
        router.update_worker(WorkerStats(WorkerId(f"w{i}"), kv_capacity_blocks=capacity))
    return router, index


def store(index: KVIndex, worker: str, block_hashes_: Sequence[BlockHash], tier: int = G1) -> None:
    index.publish(TierEvent(worker, "stored", tier, tuple(block_hashes_)))


def test_prefix_affinity_picks_the_worker_holding_the_prefix() -> None:
    router, index = make_router()
    prompt = hashes((1, 30), (2, 10))
    store(index, "w2", prompt[:30])
    decision = router.route("r1", prompt)
    assert (decision.worker_id, decision.reason, decision.reusable_blocks) == ("w2", "prefix_hit", 30)


def test_faster_tier_wins_and_a_slow_tier_beats_nothing() -> None:
    router, index = make_router(workers=3)
    prompt = hashes((1, 40))
    store(index, "w0", prompt[:30], tier=G3)
    store(index, "w1", prompt[:30], tier=G1)
    assert router.route("r1", prompt).worker_id == "w1"
    router.release("r1")
    router.remove_worker(WorkerId("w1"))
    assert router.route("r2", prompt).worker_id == "w0"


def test_g4_blocks_help_every_worker_equally() -> None:
    router, index = make_router(workers=2)
    prompt = hashes((1, 20))
    store(index, "w0", prompt[:20], tier=G4)
    router.update_worker(WorkerStats(WorkerId("w0"), kv_capacity_blocks=10_000, active_blocks=50))
    decision = router.route("r1", prompt)
    assert (decision.worker_id, decision.reusable_blocks) == ("w1", 20)


def test_hot_shared_prefix_spreads_over_all_workers() -> None:
    router, index = make_router()
    system_prompt = hashes((7, 20))
    store(index, "w0", system_prompt)
    routed: Counter[str] = Counter()
    for i in range(200):  # all in flight at once, each past its prefill (decoding)
        routed[router.route(f"r{i}", hashes((7, 20), (100 + i, 5))).worker_id] += 1
        router.prefill_done(f"r{i}")
    assert set(routed) == {"w0", "w1", "w2", "w3"}
    assert routed["w0"] == max(routed.values())
    assert max(routed.values()) - min(routed.values()) <= 2, routed


def test_queued_prefill_work_counts_as_load() -> None:
    """Requests still waiting for prefill load their worker by the prefill they need, not only their blocks."""
    router, index = make_router(
        workers=2
    )  # only w0 ever holds the system prompt (in-flight blocks not counted)
    system_prompt = hashes((7, 20))
    store(index, "w0", system_prompt)
    routed = Counter(router.route(f"r{i}", hashes((7, 20), (100 + i, 5))).worker_id for i in range(100))
    assert routed["w0"] > routed["w1"] > 20  # w0's queue is 5 blocks a request, w1's 25: w0 takes more


@pytest.mark.parametrize("count_in_flight", [True, False])
def test_in_flight_prefix_counts_before_the_index_hears_of_it(count_in_flight: bool) -> None:
    """A follow-up arriving while its prefix is still being prefilled (no event yet) goes where that prefill runs."""
    router, index = make_router(workers=2, count_in_flight=count_in_flight)
    busy = router.route("busy", hashes((9, 30)))  # both workers have a 30-block prefill queued
    first = router.route("turn-1", hashes((1, 30)))
    assert first.worker_id != busy.worker_id
    follow_up = router.route("turn-2", hashes((1, 30), (2, 10)))
    if count_in_flight:  # 10 blocks to prefill where turn-1 runs, 40 on the other worker
        assert (follow_up.worker_id, follow_up.reason, follow_up.reusable_blocks) == (
            first.worker_id,
            "prefix_hit",
            30,
        )
    else:
        assert (follow_up.reason, follow_up.reusable_blocks) == ("no_prefix", 0)
    for request_id in ("busy", "turn-1", "turn-2"):
        router.release(request_id)
    assert all(not load.in_flight_blocks for load in router._workers.values())


def test_in_flight_prefix_of_a_hot_prompt_still_spreads() -> None:
    """Counting in-flight blocks must not pile a burst of requests with one prompt onto one worker."""
    router, _ = make_router(count_in_flight=True)
    counts = Counter(router.route(f"r{i}", hashes((7, 20), (100 + i, 2))).worker_id for i in range(100))
    assert set(counts) == {"w0", "w1", "w2", "w3"} and max(counts.values()) - min(counts.values()) <= 2, (
        counts
    )


def test_busy_worker_is_skipped_even_with_the_best_prefix() -> None:
    router, index = make_router(capacity=100, busy_threshold=0.5, overlap_weight=100.0)
    store(index, "w0", hashes((7, 25)))
    assert router.route("r0", hashes((7, 25), (100, 1))).worker_id == "w0"
    router.update_worker(WorkerStats(WorkerId("w0"), 100, active_blocks=50))  # its report: half its KV in use
    chosen = [router.route(f"r{i}", hashes((7, 25), (100 + i, 1))).worker_id for i in range(1, 6)]
    assert "w0" not in chosen
    router.update_worker(WorkerStats(WorkerId("w0"), 100, active_blocks=27))
    assert router.route("again", hashes((7, 25), (99, 1))).worker_id == "w0"  # free again


def test_queued_requests_do_not_make_their_worker_busy() -> None:
    """Requests routed to a worker but not running there hold no KV: a follow-up still finds its prefix's holder
    (the queue counts in the cost, as pending prefill) until the worker reports its KV in use."""
    router, index = make_router(workers=2, capacity=100, busy_threshold=0.5, overlap_weight=100.0)
    store(index, "w0", hashes((7, 25)))
    chosen = [router.route(f"r{i}", hashes((7, 25), (100 + i, 1))).worker_id for i in range(4)]
    assert chosen == ["w0"] * 4  # 108 blocks routed to w0 (over the threshold), none reported in use
    router.update_worker(WorkerStats(WorkerId("w0"), 100, active_blocks=60))
    assert router.route("r4", hashes((7, 25), (104, 1))).worker_id == "w1"


def test_all_busy_still_routes() -> None:
    router, _ = make_router(workers=2, capacity=10, busy_threshold=0.5)
    for worker in ("w0", "w1"):
        router.update_worker(WorkerStats(WorkerId(worker), 10, active_blocks=5))
    chosen = Counter(router.route(f"r{i}", hashes((i, 9))).worker_id for i in range(6))
    assert sum(chosen.values()) == 6
    assert "strata_router_all_busy_total 6.0" in _metric_lines(router)


def test_equal_workers_share_ties_evenly() -> None:
    router, _ = make_router()
    counts: Counter[str] = Counter()
    for i in range(400):
        counts[router.route(f"r{i}", hashes((i, 4))).worker_id] += 1
        router.release(f"r{i}")
    assert counts == {"w0": 100, "w1": 100, "w2": 100, "w3": 100}


def test_least_loaded_ties_are_spread_too() -> None:
    router, _ = make_router(strategy="least-loaded")
    counts: Counter[str] = Counter()
    for i in range(40):
        counts[router.route(f"r{i}", []).worker_id] += 1
        router.release(f"r{i}")
    assert counts == {"w0": 10, "w1": 10, "w2": 10, "w3": 10}


def test_temperature_samples_around_the_best() -> None:
    router, index = make_router(workers=3, temperature=0.5, seed=3)
    prompt = hashes((1, 40))
    store(index, "w1", prompt)
    counts: Counter[str] = Counter()
    for i in range(300):
        counts[router.route(f"r{i}", prompt).worker_id] += 1
        router.release(f"r{i}")
    assert counts["w1"] == max(counts.values())
    assert counts["w0"] > 0 and counts["w2"] > 0


def test_faster_worker_gets_proportionally_more() -> None:
    router, _ = make_router(workers=0)
    router.update_worker(WorkerStats(WorkerId("slow"), 100_000, prefill_tok_s=1000, decode_tok_s=50))
    router.update_worker(WorkerStats(WorkerId("fast"), 100_000, prefill_tok_s=2000, decode_tok_s=100))
    counts = Counter(router.route(f"r{i}", hashes((i, 8))).worker_id for i in range(300))
    assert 190 <= counts["fast"] <= 210, counts


def test_unmeasured_worker_counts_as_average() -> None:
    router, _ = make_router(workers=0)
    router.update_worker(WorkerStats(WorkerId("new"), 1000))
    router.update_worker(WorkerStats(WorkerId("old"), 1000, prefill_tok_s=500, decode_tok_s=40))
    counts = Counter(router.route(f"r{i}", hashes((i, 8))).worker_id for i in range(100))
    assert 45 <= counts["new"] <= 55


class FailingLookup:
    events_applied = 0

    def __init__(self, clock: FakeClock, delay_s: float = 0.0, error: bool = True) -> None:
        self.clock, self.delay_s, self.error, self.calls = clock, delay_s, error, 0

    def query(self, block_hashes: Sequence[BlockHash]) -> PrefixReport:
        self.calls += 1
        self.clock.now += self.delay_s
        if self.error:
            raise ConnectionError("index unreachable")
        return PrefixReport(len(block_hashes))


def _router_over(lookup: FailingLookup, clock: FakeClock, **config: object) -> Router:
    router = Router(RouterConfig(fallback="round-robin", **config), lookup, clock=clock)  # type: ignore[arg-type]
    for i in range(3):
        router.update_worker(WorkerStats(WorkerId(f"w{i}"), 1000))
    return router


def test_lookup_error_falls_back_then_cools_down() -> None:
    clock = FakeClock()
    lookup = FailingLookup(clock)
    router = _router_over(lookup, clock, lookup_cooldown_s=1.0)
    first = router.route("r1", hashes((1, 4)))
    assert (first.strategy, first.reason) == ("round-robin", "lookup_error")
    second = router.route("r2", hashes((1, 4)))
    assert (second.reason, lookup.calls) == ("lookup_cooldown", 1)
    assert first.worker_id != second.worker_id
    clock.now += 1.5
    lookup.error = False
    third = router.route("r3", hashes((1, 4)))
    assert (third.strategy, third.reason, lookup.calls) == ("kv-aware", "no_prefix", 2)
    text = _metric_lines(router)
    assert 'strata_router_decisions_total{reason="lookup_error",strategy="round-robin"} 1.0' in text


def test_slow_lookup_falls_back() -> None:
    clock = FakeClock()
    router = _router_over(FailingLookup(clock, delay_s=0.02, error=False), clock, lookup_budget_s=0.005)
    assert router.route("r1", hashes((1, 4))).reason == "lookup_timeout"


def test_stale_index_sets_the_metric_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    index = KVIndex()
    router = Router(RouterConfig(stale_after_s=30), index, clock=clock)
    router.update_worker(WorkerStats(WorkerId("w0"), 1000))
    caplog.set_level(logging.WARNING, logger="server.router.staleness")
    for step in range(5):
        router.route(f"r{step}", hashes((step, 4)))
        clock.now += 10
    assert router.staleness.stale
    assert "strata_router_index_stale 1.0" in _metric_lines(router)
    assert len([r for r in caplog.records if "stale" in r.getMessage()]) == 1
    store(index, "w0", hashes((0, 4)))
    router.route("r9", hashes((9, 4)))
    assert not router.staleness.stale
    assert "strata_router_index_stale 0.0" in _metric_lines(router)


def test_fully_cached_requests_do_not_make_the_index_look_stale() -> None:
    clock = FakeClock()
    index = KVIndex()
    router = Router(RouterConfig(stale_after_s=30), index, clock=clock)
    router.update_worker(WorkerStats(WorkerId("w0"), 1000))
    prompt = hashes((1, 4))
    store(index, "w0", prompt)
    for step in range(10):
        router.route(f"r{step}", prompt)
        clock.now += 10
    assert not router.staleness.stale


def test_release_frees_the_load_and_metrics_show_it() -> None:
    router, _ = make_router(workers=1)
    router.route("r1", hashes((1, 9)))
    assert 'strata_router_worker_active_blocks{worker="w0"} 10.0' in _metric_lines(router)
    router.release("r1")
    router.release("r1")  # twice is harmless
    assert 'strata_router_worker_active_blocks{worker="w0"} 0.0' in _metric_lines(router)


def test_reported_load_counts_when_higher_than_the_routers_own() -> None:
    router, _ = make_router(workers=2, strategy="least-loaded")
    router.update_worker(WorkerStats(WorkerId("w0"), 1000, active_blocks=500))
    assert router.route("r1", hashes((1, 4))).worker_id == "w1"


def test_round_robin_and_random_cover_every_worker() -> None:
    rr, _ = make_router(strategy="round-robin")
    assert Counter(rr.route(f"r{i}", []).worker_id for i in range(8)) == {"w0": 2, "w1": 2, "w2": 2, "w3": 2}
    rnd, _ = make_router(strategy="random", seed=1)
    assert len({rnd.route(f"r{i}", []).worker_id for i in range(50)}) == 4


def test_removed_worker_gets_nothing_and_no_worker_is_an_error() -> None:
    router, _ = make_router(workers=2)
    router.remove_worker(WorkerId("w0"))
    assert {router.route(f"r{i}", hashes((i, 2))).worker_id for i in range(5)} == {"w1"}
    router.remove_worker(WorkerId("w1"))
    with pytest.raises(NoWorkerError):
        router.route("r9", [])


@pytest.mark.parametrize(
    "config",
    [
        {"strategy": "fastest"},
        {"fallback": "kv-aware"},
        {"busy_threshold": 0},
        {"temperature": -1},
    ],
)
def test_bad_config_names_the_field(config: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(config))):
        RouterConfig(**config)  # type: ignore[arg-type]


def test_kv_aware_needs_a_lookup() -> None:
    with pytest.raises(ValueError, match="lookup"):
        Router(RouterConfig())


def _metric_lines(router: Router) -> str:
    from prometheus_client import generate_latest

    return generate_latest(router.metrics.registry).decode()


def test_concurrent_route_and_release_leave_no_load_behind() -> None:
    router, index = make_router()
    store(index, "w1", hashes((7, 8)))

    def client(thread: int) -> None:
        for i in range(300):
            request_id = f"t{thread}-{i}"
            router.route(request_id, hashes((7, 8), (thread * 1000 + i, 2)))
            router.prefill_done(request_id)
            router.release(request_id)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    loads = router._workers.values()
    assert all(
        (load.routed_blocks, load.routed_requests, load.pending_prefill) == (0, 0, 0) for load in loads
    )
