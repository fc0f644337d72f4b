"""Prometheus series of the router, registered in the caller's registry (the frontend's, to share /metrics).

Labels: `strategy` is the strategy that actually picked (the fallback's name when the lookup failed);
`reason` is one of "prefix_hit" (kv-aware, the chosen worker reuses cached blocks), "no_prefix" (kv-aware, chosen
by load), "lookup_error", "lookup_timeout", "lookup_cooldown" (the fallback picked), "configured" (a non-kv
strategy was configured); `worker` is the worker id (for `strata_router_migrations_total`: the one that died).

Disaggregated serving: `strata_disagg_prefills_total{model,where,reason}` (where: remote | local; reasons in
disagg.py), `strata_disagg_prefill_queue{model}`, `strata_disagg_kv_transfer_bytes_total{model,transport}` and
`strata_disagg_kv_transfer_seconds{model,side}` (side: send | receive); `strata_workers{model,role}` counts live
workers by role.

Worker description (while the worker is in the router): `strata_worker_info` is 1 with the hardware as labels
(model, worker, host, device, device_name, cpu_cores, torch_threads); the speeds the router currently uses
(calibrated at join, then refined by traffic) and the KV capacity are gauges by `worker`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from server.workers.hardware import HardwareInfo

_TRANSFER_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)
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
    worker_info: Gauge
    worker_prefill_tok_s: Gauge
    worker_decode_tok_s: Gauge
    worker_kv_capacity_bytes: Gauge
    migrations: Counter
    worker_messages_rejected: Counter
    worker_queue_full: Counter
    workers_by_role: Gauge
    disagg_prefills: Counter
    disagg_prefill_queue: Gauge
    kv_transfer_bytes: Counter
    kv_transfer_seconds: Histogram
    _info_labels: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> RouterMetrics:
        reg = registry if registry is not None else CollectorRegistry()
        return cls(
            registry=reg,
            decisions=Counter(
                "strata_router_decisions", "Routing decisions", ("strategy", "reason"), registry=reg
            ),
            decision_seconds=Histogram(
                "strata_router_decision_seconds",
                "Time to pick a worker incl. the lookup",
                buckets=_DECISION_BUCKETS,
                registry=reg,
            ),
            all_busy=Counter(
                "strata_router_all_busy",
                "Decisions taken with every worker above busy_threshold",
                registry=reg,
            ),
            request_blocks=Counter(
                "strata_router_request_blocks", "Full blocks of routed requests", registry=reg
            ),
            reusable_blocks=Counter(
                "strata_router_reusable_blocks",
                "Leading blocks the chosen worker held in some tier (predicted hits)",
                registry=reg,
            ),
            index_stale=Gauge(
                "strata_router_index_stale",
                "1 while requests flow and the KV index has applied no event for stale_after_s",
                registry=reg,
            ),
            worker_active_blocks=Gauge(
                "strata_router_worker_active_blocks",
                "KV blocks in use per worker (max of report and router's count)",
                ("worker",),
                registry=reg,
            ),
            worker_in_flight=Gauge(
                "strata_router_worker_in_flight",
                "Requests running or queued per worker",
                ("worker",),
                registry=reg,
            ),
            worker_info=Gauge(
                "strata_worker_info",
                "1 per worker in the router; its hardware as labels",
                _INFO_LABELS,
                registry=reg,
            ),
            worker_prefill_tok_s=Gauge(
                "strata_worker_prefill_tokens_per_second",
                "Prefill speed the router uses per worker (calibrated, then measured)",
                ("worker",),
                registry=reg,
            ),
            worker_decode_tok_s=Gauge(
                "strata_worker_decode_tokens_per_second",
                "Decode speed per request the router uses per worker (calibrated, then measured)",
                ("worker",),
                registry=reg,
            ),
            worker_kv_capacity_bytes=Gauge(
                "strata_worker_kv_capacity_bytes", "KV pool of each worker, bytes", ("worker",), registry=reg
            ),
            migrations=Counter(
                "strata_router_migrations",
                "Requests resumed on another worker after `worker` died or left mid-request",
                ("worker",),
                registry=reg,
            ),
            worker_messages_rejected=Counter(
                "strata_worker_messages_rejected",
                "Frames on a worker's link that were not messages (each drops the worker)",
                ("worker",),
                registry=reg,
            ),
            worker_queue_full=Counter(
                "strata_worker_queue_full",
                "Requests a worker refused because its wait queue was full (max_queued_requests); the router "
                "then tries the next worker",
                ("worker",),
                registry=reg,
            ),
            workers_by_role=Gauge(
                "strata_workers",
                "Live workers of a model by role (prefill, decode, both)",
                ("model", "role"),
                registry=reg,
            ),
            disagg_prefills=Counter(
                "strata_disagg_prefills",
                "Prefills of a model with prefill workers, where they ran (remote: a prefill worker, local: the "
                "decode worker) and why (server/router/disagg.py)",
                ("model", "where", "reason"),
                registry=reg,
            ),
            disagg_prefill_queue=Gauge(
                "strata_disagg_prefill_queue",
                "Remote prefills in flight: sent to a prefill worker, not yet handed off",
                ("model",),
                registry=reg,
            ),
            kv_transfer_bytes=Counter(
                "strata_disagg_kv_transfer_bytes",
                "KV bytes handed from prefill to decode workers, by transport (shm, tcp)",
                ("model", "transport"),
                registry=reg,
            ),
            kv_transfer_seconds=Histogram(
                "strata_disagg_kv_transfer_seconds",
                "Time to move one request's KV: send (prefill worker's engine thread) and receive (decode "
                "worker's read into its pool)",
                ("model", "side"),
                buckets=_TRANSFER_BUCKETS,
                registry=reg,
            ),
        )

    def show_worker(self, model: str, worker: str, hardware: HardwareInfo | None) -> None:
        """Export a worker's description (replacing an earlier one under the same id)."""
        self.hide_worker(worker)
        hw = hardware
        labels = (
            (model, worker, hw.host, hw.device, hw.device_name, str(hw.cpu_cores), str(hw.torch_threads))
            if hw
            else (model, worker, "", "", "", "", "")
        )
        self._info_labels[worker] = labels
        self.worker_info.labels(*labels).set(1)
        self.worker_kv_capacity_bytes.labels(worker).set(hw.kv_capacity_bytes if hw else 0)

    def show_speeds(self, worker: str, prefill_tok_s: float, decode_tok_s: float) -> None:
        self.worker_prefill_tok_s.labels(worker).set(prefill_tok_s)
        self.worker_decode_tok_s.labels(worker).set(decode_tok_s)

    def hide_worker(self, worker: str) -> None:
        """Drop a worker's description and speeds (it left the router)."""
        labels = self._info_labels.pop(worker, None)
        if labels is None:
            return
        self.worker_info.remove(*labels)
        for gauge in (self.worker_prefill_tok_s, self.worker_decode_tok_s, self.worker_kv_capacity_bytes):
            with contextlib.suppress(KeyError):  # speeds are exported from the first report on
                gauge.remove(worker)


_INFO_LABELS = ("model", "worker", "host", "device", "device_name", "cpu_cores", "torch_threads")
