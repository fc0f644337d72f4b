"""Prometheus series of the router, registered in the caller's registry (the frontend's, to share /metrics).

Labels: `strategy` is the strategy that actually picked (the fallback's name when the lookup failed);
`reason` is one of "prefix_hit" (kv-aware, the chosen worker reuses cached blocks), "no_prefix" (kv-aware, chosen
by load), "lookup_error", "lookup_timeout", "lookup_cooldown" (the fallback picked), "configured" (a non-kv
strategy was configured); `worker` is the worker id.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_DECISION_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 300e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)


@dataclass(slots=True)
class RouterMetrics:
    registry: CollectorRegistry
    decisions: Counter
    decision_seconds: Histogram
    all_busy: Counter
    request_blocks: Counter
    reusable_blocks: Counter
    index_stale: Gauge
    worker_active_blocks: Gauge
    worker_in_flight: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> RouterMetrics:
        reg = registry if registry is not None else CollectorRegistry()
        return cls(
            registry=reg,
            decisions=Counter("strata_router_decisions", "Routing decisions", ("strategy", "reason"), registry=reg),
            decision_seconds=Histogram("strata_router_decision_seconds", "Time to pick a worker incl. the lookup",
                                       buckets=_DECISION_BUCKETS, registry=reg),
            all_busy=Counter("strata_router_all_busy", "Decisions taken with every worker above busy_threshold",
                             registry=reg),
            request_blocks=Counter("strata_router_request_blocks", "Full blocks of routed requests", registry=reg),
            reusable_blocks=Counter("strata_router_reusable_blocks",
                                    "Leading blocks the chosen worker held in some tier (predicted hits)",
                                    registry=reg),
            index_stale=Gauge("strata_router_index_stale",
                              "1 while requests flow and the KV index has applied no event for stale_after_s",
                              registry=reg),
            worker_active_blocks=Gauge("strata_router_worker_active_blocks",
                                       "KV blocks in use per worker (max of report and router's count)",
                                       ("worker",), registry=reg),
            worker_in_flight=Gauge("strata_router_worker_in_flight", "Requests running or queued per worker",
                                   ("worker",), registry=reg),
        )
