"""KV Block Manager: tiered KV block storage (G1 device .. G5 object store) and the index of who holds which block.

Public API (the rest is internal):

    kvbm.config.KVBMConfig            sizes, disk path, Redis url, write-through, TTL (--kvbm-* flags map onto it)
    kvbm.agent.build_connector(...)   -> KVBMConnector, the engine's KVConnector (pass it to LLMEngine)
    kvbm.index.KVIndex                embedded index; .query(block_hashes) -> PrefixReport
    kvbm.service.run_service(...)     the standalone service (`strata kvbm`, `python -m kvbm`: flags in kvbm.cli)
    kvbm.client.KVIndexClient         the standalone service's index over ZMQ CURVE (kvbm.wire), same .query
    kvbm.metrics.KVBMMetrics          Prometheus metrics on a registry the caller passes in
    kvbm.host_pool.pid_alive(pid)     is a process running (for cleaning up after dead runs)

Tiers, one module each behind `kvbm.tier.BlockTier`: host_pool (G2, POSIX shared memory), disk_pool (G3),
redis_pool (G4), object_pool (G5, an S3 bucket). Events: events.TierEvent, over channel.RedisWorkerChannel (Redis Stream + lease) when the
service is standalone. The cluster secret, CURVE keys and the Redis link come from the `cluster` package.
"""
