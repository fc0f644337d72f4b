"""Prometheus metrics of the KVBM, all on one registry the caller passes in (a fresh one by default)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TIER = ["model", "tier"]
_DIRECTION = ["model", "direction"]
_LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class KVBMMetrics:
    """Labels: `model` is the served model whose engine holds the blocks; `tier` is G1..G5; `direction` is "G1->G2",
    "G2->G1", "G2->G3", ... (source -> destination). Tier and transfer series are a model's (`for_model`); the
    index's, the query port's and Redis's are the process's (the index spans every model's workers)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.blocks_used = Gauge("kvbm_tier_blocks_used", "Blocks held per tier", _TIER, registry=reg)
        self.blocks_capacity = Gauge("kvbm_tier_blocks_capacity", "Block slots per tier", _TIER, registry=reg)
        self.bytes_used = Gauge("kvbm_tier_bytes_used", "Payload bytes held per tier", _TIER, registry=reg)
        self.bytes_capacity = Gauge("kvbm_tier_bytes_capacity", "Payload bytes per tier", _TIER, registry=reg)
        self.hits = Counter("kvbm_hits", "Blocks found per tier on lookup/onboard", _TIER, registry=reg)
        self.misses = Counter("kvbm_misses", "Blocks asked of a tier and not found", _TIER, registry=reg)
        self.offload_blocks = Counter("kvbm_offload_blocks", "Blocks copied down", _DIRECTION, registry=reg)
        self.onboard_blocks = Counter("kvbm_onboard_blocks", "Blocks copied up", _DIRECTION, registry=reg)
        self.transfer_bytes = Counter("kvbm_transfer_bytes", "Bytes moved", _DIRECTION, registry=reg)
        self.transfer_seconds = Histogram(
            "kvbm_transfer_seconds",
            "One batched transfer",
            _DIRECTION,
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.checksum_failures = Counter(
            "kvbm_checksum_failures",
            "Blocks whose bytes failed verification (served as a miss)",
            _TIER,
            registry=reg,
        )
        self.object_requests = Counter(
            "kvbm_object_requests",
            "Object-store requests of the G5 tier by operation (head, get, put, delete, list) and outcome (ok,"
            " missing, present, corrupt, denied, throttled, timeout, error; skipped: circuit open; dropped:"
            " upload queue full)",
            ["model", "tier", "op", "outcome"],
            registry=reg,
        )
        self.object_up = Gauge(
            "kvbm_object_store_up",
            "1 while the object tier's circuit is closed (its last request succeeded)",
            _TIER,
            registry=reg,
        )
        self.auth_failures = Counter(
            "kvbm_service_auth_failures",
            "CURVE handshakes the KVBM service's query port refused (no or another cluster secret)",
            registry=reg,
        )
        self.events_rejected = Counter(
            "kvbm_service_events_rejected",
            "KV event stream entries the service skipped as malformed",
            registry=reg,
        )
        self.redis_up = Gauge("kvbm_redis_up", "1 while the last Redis call succeeded", registry=reg)
        self.index_blocks = Gauge("kvbm_index_blocks", "Block hashes in the KVBM service index", registry=reg)
        self.index_workers = Gauge(
            "kvbm_index_workers", "Live workers in the KVBM service index", registry=reg
        )
        self.event_lag = Histogram(
            "kvbm_event_lag_seconds",
            "Publish-to-apply delay of block events",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )

    def for_model(self, model: str) -> TierMetrics:
        """The tier and transfer series of `model`'s engine (one per engine; a reloaded model shares them)."""
        return TierMetrics(self, model)


class TierMetrics:
    """One model's KVBM tier and transfer series: what a connector and its tiers record."""

    def __init__(self, metrics: KVBMMetrics, model: str) -> None:
        self.all = metrics
        self.model = model
        self.registry = metrics.registry
        self.redis_up = metrics.redis_up

    def set_capacity(self, tier: str, blocks: int, block_bytes: int) -> None:
        self.all.blocks_capacity.labels(self.model, tier).set(blocks)
        self.all.bytes_capacity.labels(self.model, tier).set(blocks * block_bytes)

    def set_used(self, tier: str, blocks: int, block_bytes: int) -> None:
        self.all.blocks_used.labels(self.model, tier).set(blocks)
        self.all.bytes_used.labels(self.model, tier).set(blocks * block_bytes)

    def record_lookup(self, tier: str, hits: int, misses: int) -> None:
        self.all.hits.labels(self.model, tier).inc(hits)
        self.all.misses.labels(self.model, tier).inc(misses)

    def record_checksum_failure(self, tier: str) -> None:
        self.all.checksum_failures.labels(self.model, tier).inc()

    def record_object_request(self, tier: str, op: str, outcome: str, n: int = 1) -> None:
        self.all.object_requests.labels(self.model, tier, op, outcome).inc(n)

    def set_object_up(self, tier: str, up: bool) -> None:
        self.all.object_up.labels(self.model, tier).set(1 if up else 0)

    def record_transfer(self, direction: str, blocks: int, nbytes: int, seconds: float) -> None:
        metrics = self.all
        counter = metrics.onboard_blocks if direction.endswith("G1") else metrics.offload_blocks
        counter.labels(self.model, direction).inc(blocks)
        metrics.transfer_bytes.labels(self.model, direction).inc(nbytes)
        metrics.transfer_seconds.labels(self.model, direction).observe(seconds)
