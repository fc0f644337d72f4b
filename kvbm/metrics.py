"""Prometheus metrics of the KVBM, all on one registry the caller passes in (a fresh one by default)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class KVBMMetrics:
    """Labels: `tier` is G1..G4; `direction` is "G1->G2", "G2->G1", "G2->G3", ... (source -> destination)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.blocks_used = Gauge("kvbm_tier_blocks_used", "Blocks held per tier", ["tier"], registry=reg)
        self.blocks_capacity = Gauge(
            "kvbm_tier_blocks_capacity", "Block slots per tier", ["tier"], registry=reg
        )
        self.bytes_used = Gauge("kvbm_tier_bytes_used", "Payload bytes held per tier", ["tier"], registry=reg)
        self.bytes_capacity = Gauge(
            "kvbm_tier_bytes_capacity", "Payload bytes per tier", ["tier"], registry=reg
        )
        self.hits = Counter("kvbm_hits", "Blocks found per tier on lookup/onboard", ["tier"], registry=reg)
        self.misses = Counter("kvbm_misses", "Blocks asked of a tier and not found", ["tier"], registry=reg)
        self.offload_blocks = Counter(
            "kvbm_offload_blocks", "Blocks copied down", ["direction"], registry=reg
        )
        self.onboard_blocks = Counter("kvbm_onboard_blocks", "Blocks copied up", ["direction"], registry=reg)
        self.transfer_bytes = Counter("kvbm_transfer_bytes", "Bytes moved", ["direction"], registry=reg)
        self.transfer_seconds = Histogram(
            "kvbm_transfer_seconds",
            "One batched transfer",
            ["direction"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.checksum_failures = Counter(
            "kvbm_checksum_failures",
            "Blocks whose bytes failed verification (served as a miss)",
            ["tier"],
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

    def set_capacity(self, tier: str, blocks: int, block_bytes: int) -> None:
        self.blocks_capacity.labels(tier).set(blocks)
        self.bytes_capacity.labels(tier).set(blocks * block_bytes)

    def set_used(self, tier: str, blocks: int, block_bytes: int) -> None:
        self.blocks_used.labels(tier).set(blocks)
        self.bytes_used.labels(tier).set(blocks * block_bytes)

    def record_transfer(self, direction: str, blocks: int, nbytes: int, seconds: float) -> None:
        counter = self.onboard_blocks if direction.endswith("G1") else self.offload_blocks
        counter.labels(direction).inc(blocks)
        self.transfer_bytes.labels(direction).inc(nbytes)
        self.transfer_seconds.labels(direction).observe(seconds)
