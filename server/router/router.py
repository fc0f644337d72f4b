"""Picks a worker per request: KV-aware (Dynamo's cost function) or round-robin / random / least-loaded.

Thread-safety: `route`, `release`, `update_worker` and `remove_worker` may be called from any thread. The index
lookup runs outside the router's lock; the choice and the bookkeeping run under it.

Balance: the router adds each request's blocks to its worker's load at once (reports lag), breaks exact ties by
rotation, skips workers whose last report shows `busy_threshold` of their KV in use by running requests (queued
ones count in the cost, as pending prefill), and at temperature > 0 samples workers
with probability softmax(-normalized cost / temperature) -- so one hot shared prefix spreads once its holder is
loaded by more than the prefix is worth. With `count_in_flight`, a worker also holds (for the cost) the blocks of
the requests routed to it and not yet released: the index hears of blocks only after their prefill, but a
request arriving meanwhile with the same prefix is cheapest where that prefill runs (the engine lets it wait
for those blocks instead of computing them twice).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kvbm.block_hash import BlockHash
from kvbm.index import PrefixReport, WorkerPrefix
from server.engine.api import EngineUnavailable
from server.router.config import RouterConfig, Strategy
from server.router.cost import SharedPrefix, blocks_to_prefill, reusable_blocks, worker_cost
from server.router.load import WorkerLoad, relative_speeds
from server.router.lookup import OverlapLookup
from server.router.metrics import RouterMetrics
from server.router.staleness import StalenessCheck
from server.workers.protocol import WorkerId, WorkerStats

logger = logging.getLogger(__name__)


class NoWorkerError(EngineUnavailable):
    """No worker is registered."""


@dataclass(frozen=True, slots=True)
class RouteDecision:
    worker_id: WorkerId
    strategy: Strategy  # the strategy that picked: the fallback's name when the lookup failed
    reason: str  # see server.router.metrics
    num_blocks: int  # full blocks of the request
    reusable_blocks: int  # leading blocks the chosen worker holds in some tier (0 when unknown)
    cost: float | None = None  # kv-aware: the chosen worker's cost (cost.py), None for the other strategies


@dataclass(slots=True)
class _Routed:
    """A routed request not yet released; its blocks and pending prefill load its worker."""

    worker_id: WorkerId
    blocks: int
    pending_prefill: float  # blocks of prefill work until its first token
    block_hashes: Sequence[BlockHash] = ()  # held in its worker's in-flight blocks (count_in_flight)


class Router:
    def __init__(
        self,
        config: RouterConfig,
        lookup: OverlapLookup | None = None,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.strategy == "kv-aware" and lookup is None:
            raise ValueError("router: kv-aware routing needs an overlap lookup (the KVBM index)")
        self.config = config
        self.metrics = metrics or RouterMetrics.create()
        self._lookup = lookup
        self._clock = clock
        self._rng = random.Random(config.seed)
        self._workers: dict[WorkerId, WorkerLoad] = {}
        self._routed: dict[str, _Routed] = {}
        self._lock = threading.Lock()
        self._turn = 0  # rotates ties and round-robin
        self._lookup_paused_until = -math.inf
        self.staleness = StalenessCheck(config.stale_after_s, self.metrics.index_stale)

    @property
    def workers(self) -> list[WorkerId]:
        return list(self._workers)

    def update_worker(self, stats: WorkerStats) -> None:
        """Add a worker or refresh its report (capacity, load, measured speeds)."""
        with self._lock:
            load = self._workers.get(stats.worker_id)
            if load is None:
                self._workers[stats.worker_id] = WorkerLoad(stats)
            else:
                load.stats = stats
            self._refresh_speeds()
            self._publish_load(self._workers[stats.worker_id])

    def remove_worker(self, worker_id: WorkerId) -> None:
        """Stop routing to a worker (dead or drained); its routed requests are forgotten."""
        with self._lock:
            if self._workers.pop(worker_id, None) is None:
                return
            self._routed = {
                rid: routed for rid, routed in self._routed.items() if routed.worker_id != worker_id
            }
            self._refresh_speeds()
            self.metrics.worker_active_blocks.remove(worker_id)
            self.metrics.worker_in_flight.remove(worker_id)

    def route(
        self, request_id: str, block_hashes: Sequence[BlockHash], exclude: Collection[WorkerId] = ()
    ) -> RouteDecision:
        """Pick a worker (other than those in `exclude`) for a request and count its blocks there until
        `release(request_id)` (and its prefill work until `prefill_done(request_id)` or release)."""
        started = time.perf_counter()
        report, events, failure = (
            self._query(block_hashes) if self.config.strategy == "kv-aware" else (None, 0, None)
        )
        with self._lock:
            if not self._workers.keys() - set(exclude):
                raise NoWorkerError(
                    "no worker is registered with the router"
                    if not self._workers
                    else "no worker left to try"
                )
            if report is not None and block_hashes:
                self.staleness.observe(events, self._clock(), _stores_new_blocks(report, len(block_hashes)))
            candidates = self._candidates(exclude)
            prefixes: dict[str, WorkerPrefix] = {}
            if report is not None:
                prefixes = self._prefixes(candidates, report, block_hashes)
                worker, reason, cost = self._pick_kv_aware(
                    candidates, prefixes, SharedPrefix.of(report), len(block_hashes)
                )
                strategy = self.config.strategy
            else:
                strategy = self.config.fallback if failure else self.config.strategy
                worker, reason, cost = self._pick_simple(strategy, candidates), failure or "configured", None
            decision = self._record(
                request_id,
                worker,
                strategy,
                reason,
                block_hashes,
                prefixes.get(worker.stats.worker_id),
                SharedPrefix.of(report),
                cost,
            )
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        if logger.isEnabledFor(logging.DEBUG):
            self._log_decision(request_id, decision, prefixes, SharedPrefix.of(report))
        return decision

    def _log_decision(
        self,
        request_id: str,
        decision: RouteDecision,
        prefixes: dict[str, WorkerPrefix],
        shared: SharedPrefix,
    ) -> None:
        """One line per decision: each worker's reusable prefix, load (this request already counted on its
        worker), relative speeds, and whether it was skipped as busy. Read by bench/routing_replay_serve.py
        --keep-logs to tell where cache hits were lost."""
        with self._lock:
            others = {
                worker_id: (
                    reusable_blocks(prefixes.get(worker_id), shared),
                    load.active_blocks,
                    load.stats.active_blocks,
                    round(load.pending_prefill, 1),
                    round(load.prefill_speed, 2),
                    round(load.decode_speed, 2),
                    load.is_busy(self.config.busy_threshold),
                )
                for worker_id, load in self._workers.items()
            }
        logger.debug(
            "route %s -> %s (%s/%s, %d of %d blocks reusable); workers (reusable, active, KV in use, "
            "pending, prefill speed, decode speed, busy): %s",
            request_id,
            decision.worker_id,
            decision.strategy,
            decision.reason,
            decision.reusable_blocks,
            decision.num_blocks,
            others,
        )

    def prefill_done(self, request_id: str) -> None:
        """The request produced its first token: its prefill no longer queues ahead of new requests."""
        with self._lock:
            routed = self._routed.get(request_id)
            load = self._workers.get(routed.worker_id) if routed is not None else None
            if load is not None:
                load.pending_prefill = max(0.0, load.pending_prefill - routed.pending_prefill)
            if routed is not None:
                routed.pending_prefill = 0.0

    def release(self, request_id: str) -> None:
        """The request finished (or was aborted): its blocks no longer load its worker."""
        self.prefill_done(request_id)
        with self._lock:
            routed = self._routed.pop(request_id, None)
            load = self._workers.get(routed.worker_id) if routed is not None else None
            if load is not None:
                load.routed_blocks -= routed.blocks
                load.routed_requests -= 1
                load.drop(routed.block_hashes)
                # the last report may have been taken while this request ran: without this, a client's next
                # turn sent right after this one ends would see its cache holder loaded until the next report
                load.stats.active_blocks = max(0, load.stats.active_blocks - routed.blocks)
                load.stats.in_flight = max(0, load.stats.in_flight - 1)
                self._publish_load(load)

    def _query(self, block_hashes: Sequence[BlockHash]) -> tuple[PrefixReport | None, int, str | None]:
        """(the index's answer, its event count), or the reason to fall back (failed, too slow, cooling down)."""
        if not block_hashes:
            return PrefixReport(0), 0, None
        now = self._clock()
        if now < self._lookup_paused_until:
            return None, 0, "lookup_cooldown"
        try:
            report = self._lookup.query(block_hashes)  # type: ignore[union-attr]
            events = self._lookup.events_applied  # type: ignore[union-attr]
        except Exception:
            logger.warning(
                "KV index lookup failed; using %s for %.1f s",
                self.config.fallback,
                self.config.lookup_cooldown_s,
                exc_info=True,
            )
            self._lookup_paused_until = now + self.config.lookup_cooldown_s
            return None, 0, "lookup_error"
        elapsed = self._clock() - now
        if elapsed > self.config.lookup_budget_s:
            logger.warning(
                "KV index lookup took %.1f ms (budget %.1f ms); using %s for %.1f s",
                elapsed * 1e3,
                self.config.lookup_budget_s * 1e3,
                self.config.fallback,
                self.config.lookup_cooldown_s,
            )
            self._lookup_paused_until = now + self.config.lookup_cooldown_s
            return None, 0, "lookup_timeout"
        return report, events, None

    def _candidates(self, exclude: Collection[WorkerId] = ()) -> list[WorkerLoad]:
        loads = [load for worker_id, load in self._workers.items() if worker_id not in exclude]
        free = [load for load in loads if not load.is_busy(self.config.busy_threshold)]
        if not free:
            self.metrics.all_busy.inc()
        return free or loads

    def _prefixes(
        self, candidates: list[WorkerLoad], report: PrefixReport, block_hashes: Sequence[BlockHash]
    ) -> dict[str, WorkerPrefix]:
        """The index's prefixes per worker, raised to the blocks of its in-flight requests (count_in_flight)."""
        prefixes = report.workers
        if not self.config.count_in_flight:
            return prefixes
        raised = dict(prefixes)
        for load in candidates:
            held = load.in_flight_prefix(block_hashes)
            known = prefixes.get(load.stats.worker_id)
            if held and (known is None or known.g1 < held):
                raised[load.stats.worker_id] = (
                    WorkerPrefix(held, max(held, known.g2), max(held, known.g3))
                    if known is not None
                    else WorkerPrefix(held, held, held)
                )
        return raised

    def _pick_kv_aware(
        self,
        candidates: list[WorkerLoad],
        prefixes: dict[str, WorkerPrefix],
        shared: SharedPrefix,
        num_blocks: int,
    ) -> tuple[WorkerLoad, str, float]:
        """The chosen worker, why (prefix_hit or no_prefix) and its cost."""
        costs = [
            worker_cost(load, num_blocks, prefixes.get(load.stats.worker_id), shared, self.config)
            for load in candidates
        ]
        index = self._sample(costs) if self.config.temperature > 0 else self._argmin(costs)
        chosen = candidates[index]
        hit = reusable_blocks(prefixes.get(chosen.stats.worker_id), shared) > 0
        return chosen, "prefix_hit" if hit else "no_prefix", costs[index]

    def _pick_simple(self, strategy: Strategy, candidates: list[WorkerLoad]) -> WorkerLoad:
        if strategy == "round-robin":
            self._turn += 1
            return candidates[self._turn % len(candidates)]
        if strategy == "random":
            return self._rng.choice(candidates)
        return candidates[self._argmin([load.active_blocks / load.decode_speed for load in candidates])]

    def _argmin(self, costs: list[float]) -> int:
        """Index of the lowest cost; exact ties take turns, so equal workers share the traffic evenly."""
        best = min(costs)
        ties = [i for i, cost in enumerate(costs) if cost <= best + 1e-9 * max(1.0, abs(best))]
        if len(ties) == 1:
            return ties[0]
        self._turn += 1
        return ties[self._turn % len(ties)]

    def _sample(self, costs: list[float]) -> int:
        """Softmax over costs normalized to [0, 1], at the configured temperature."""
        low, high = min(costs), max(costs)
        span = high - low or 1.0
        weights = [math.exp(-(cost - low) / span / self.config.temperature) for cost in costs]
        return self._rng.choices(range(len(costs)), weights=weights)[0]

    def _record(
        self,
        request_id: str,
        worker: WorkerLoad,
        strategy: Strategy,
        reason: str,
        block_hashes: Sequence[BlockHash],
        prefix: WorkerPrefix | None,
        shared: SharedPrefix,
        cost: float | None,
    ) -> RouteDecision:
        worker_id = worker.stats.worker_id
        num_blocks = len(block_hashes)
        reusable = reusable_blocks(prefix, shared)
        prefill = blocks_to_prefill(num_blocks, prefix, shared, self.config)
        held = (
            tuple(block_hashes) if self.config.count_in_flight and self.config.strategy == "kv-aware" else ()
        )
        # +1 block: the partial last block and decode growth
        self._routed[request_id] = _Routed(worker_id, num_blocks + 1, prefill, held)
        worker.hold(held)
        worker.routed_blocks += num_blocks + 1
        worker.routed_requests += 1
        worker.pending_prefill += prefill
        self._publish_load(worker)
        self.metrics.decisions.labels(strategy, reason).inc()
        self.metrics.request_blocks.inc(num_blocks)
        self.metrics.reusable_blocks.inc(reusable)
        return RouteDecision(worker_id, strategy, reason, num_blocks, reusable, cost)

    def _refresh_speeds(self) -> None:
        loads = list(self._workers.values())
        prefill = relative_speeds([load.stats.prefill_tok_s for load in loads])
        decode = relative_speeds([load.stats.decode_tok_s for load in loads])
        for load, prefill_speed, decode_speed in zip(loads, prefill, decode, strict=True):
            load.prefill_speed, load.decode_speed = prefill_speed, decode_speed

    def _publish_load(self, load: WorkerLoad) -> None:
        self.metrics.worker_active_blocks.labels(load.stats.worker_id).set(load.active_blocks)
        self.metrics.worker_in_flight.labels(load.stats.worker_id).set(load.in_flight)


def _stores_new_blocks(report: PrefixReport, num_blocks: int) -> bool:
    """True when no worker holds all the blocks in G1, so serving the request will store (and announce) some."""
    return num_blocks > 0 and all(prefix.g1 < num_blocks for prefix in report.workers.values())
