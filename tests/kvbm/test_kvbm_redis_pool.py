"""G4 Redis pool against a real redis-server: round trip, verification, capacity, TTL, outage and recovery."""

from __future__ import annotations

import time

import numpy as np
import redis
from kvbm_testing import BLOCK_KEY

import cluster.redis_link as redis_link_module
import kvbm.redis_pool as redis_pool_module
from cluster.redis_link import MAX_BACKOFF_S, RedisLink
from harness.redis_server import RedisServer
from harness.waiting import wait_for
from kvbm.block_hash import BlockHash
from kvbm.metrics import KVBMMetrics, TierMetrics
from kvbm.redis_pool import FETCH_CHUNK_BLOCKS, RedisPool
from kvbm.signing import block_mac

BLOCK = 4096


def data(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(count)]


def pool_for(
    url: str, fingerprint: str = "fp", metrics: TierMetrics | None = None, key: bytes = BLOCK_KEY, **kwargs
) -> RedisPool:
    return RedisPool(
        RedisLink(url, None if metrics is None else metrics.redis_up, timeout_s=0.5),
        key,
        fingerprint,
        BLOCK,
        metrics=metrics,
        **kwargs,
    )


def count_requests(pool: RedisPool, monkeypatch) -> list[int]:
    """A one-item list counting the pool's requests to Redis from now on (each is one pipeline)."""
    count = [0]
    pipeline = pool.link.client.pipeline

    def counted(*args, **kwargs):
        count[0] += 1
        return pipeline(*args, **kwargs)

    monkeypatch.setattr(pool.link.client, "pipeline", counted)
    return count


def read(pool: RedisPool, hashes: list[int]) -> tuple[list[bool], list[np.ndarray]]:
    dests = [np.zeros(BLOCK, np.uint8) for _ in hashes]
    return pool.get([BlockHash(h) for h in hashes], dests), dests


def test_round_trip(redis_url: str) -> None:
    pool = pool_for(redis_url)
    blocks = data(3)
    assert pool.put([BlockHash(h) for h in (1, 2, 3)], blocks).stored == [1, 2, 3]
    assert pool.contains([BlockHash(h) for h in (1, 2, 3, 4)]) == [True, True, True, False]
    ok, dests = read(pool, [3, 4, 1])
    assert ok == [True, False, True]
    assert np.array_equal(dests[0], blocks[2]) and np.array_equal(dests[2], blocks[0])


def test_corrupted_value_is_a_miss_and_a_metric(redis_url: str) -> None:
    metrics = KVBMMetrics().for_model("m")
    pool = pool_for(redis_url, metrics=metrics)
    pool.put([BlockHash(1), BlockHash(2)], data(2))
    client = redis.Redis.from_url(redis_url)
    value = bytearray(client.get(pool.key(BlockHash(1))))
    value[100] ^= 0xFF
    client.set(pool.key(BlockHash(1)), bytes(value))
    client.set(pool.key(BlockHash(2)), b"short")
    ok, dests = read(pool, [1, 2])
    assert ok == [False, False] and not dests[0].any()
    assert (
        metrics.registry.get_sample_value("kvbm_checksum_failures_total", {"model": "m", "tier": "G4"}) == 2
    )


def test_other_layout_never_reads_these_blocks(redis_url: str) -> None:
    pool_for(redis_url, "model-a").put([BlockHash(1)], data(1))
    other = pool_for(redis_url, "model-b")
    assert other.contains([BlockHash(1)]) == [False]
    assert read(other, [1])[0] == [False]


class StepClock:
    """kvbm.redis_pool's `time` in a test: time() advances one second per call, so the read that touches a block
    scores it later than the put that stored it (the LRU score is that clock's time)."""

    def __init__(self) -> None:
        self.now = 1e9

    def time(self) -> float:
        self.now += 1.0
        return self.now


def test_capacity_trims_least_recently_used(redis_url: str, monkeypatch) -> None:
    monkeypatch.setattr(redis_pool_module, "time", StepClock())
    evicted: list[int] = []
    pool = pool_for(
        redis_url, capacity_blocks=3, on_evict=lambda gone: evicted.extend(b.block_hash for b in gone)
    )
    pool.put([BlockHash(1), BlockHash(2), BlockHash(3)], data(3))
    read(pool, [1])
    pool.put([BlockHash(4)], data(1))
    assert evicted == [2]
    assert pool.contains([BlockHash(h) for h in (1, 2, 3, 4)]) == [True, False, True, True]


def test_ttl_is_set(redis_url: str) -> None:
    pool = pool_for(redis_url, ttl_s=30)
    pool.put([BlockHash(1)], data(1))
    assert 0 < redis.Redis.from_url(redis_url).ttl(pool.key(BlockHash(1))) <= 30


class FrozenClock:
    """cluster.redis_link's `time` in a test: monotonic() stands still, so a backoff period never ends."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


def test_outage_is_skipped_and_recovers(monkeypatch) -> None:
    """No retry storm: the first call that finds Redis down is the only one that tries it within the link's
    backoff period (the link's clock stands still here, so the period never ends); later calls return their
    default without a request. Once Redis is back, the next try after the backoff reaches it."""
    server = RedisServer()
    server.start()
    try:
        metrics = KVBMMetrics().for_model("m")
        pool = pool_for(server.url, metrics=metrics)
        blocks = data(2)
        pool.put([BlockHash(1)], blocks[:1])
        requests = count_requests(pool, monkeypatch)
        monkeypatch.setattr(redis_link_module, "time", FrozenClock())
        server.stop()
        assert pool.put([BlockHash(2)], blocks[1:]).rejected == [0]
        assert read(pool, [1])[0] == [False]
        assert pool.contains([BlockHash(1)]) == [False]
        assert requests == [1]  # the put found Redis down; the read and the lookup cost no request
        assert metrics.registry.get_sample_value("kvbm_redis_up") == 0
        server.start()
        monkeypatch.setattr(redis_link_module, "time", time)
        # Redis is another process: polling a put is the only way to see it back; the link tries once per
        # backoff period (at most MAX_BACKOFF_S), so twice that bounds the wait
        wait_for(
            lambda: not pool.put([BlockHash(2)], blocks[1:]).rejected,
            timeout=2 * MAX_BACKOFF_S,
            what="G4 to take a put again",
        )
        assert read(pool, [2])[0] == [True]
        assert metrics.registry.get_sample_value("kvbm_redis_up") == 1
    finally:
        server.stop()


def test_a_forged_or_moved_block_is_a_miss_and_a_metric(redis_url: str) -> None:
    """Someone who can write to Redis but lacks the cluster secret cannot get a block served: not one signed with
    another key, not a real block copied under another hash."""
    metrics = KVBMMetrics().for_model("m")
    pool = pool_for(redis_url, metrics=metrics)
    blocks = data(2)
    pool.put([BlockHash(1), BlockHash(2)], blocks)
    attacker = pool_for(redis_url, key=bytes(32))  # a well-formed value signed with the wrong key
    attacker.put([BlockHash(3)], data(1, seed=9))
    client = redis.Redis.from_url(redis_url)
    client.set(pool.key(BlockHash(4)), client.get(pool.key(BlockHash(1))))  # a real block moved to hash 4
    ok, dests = read(pool, [1, 3, 4])
    assert ok == [True, False, False]
    assert np.array_equal(dests[0], blocks[0]) and not dests[1].any() and not dests[2].any()
    assert (
        metrics.registry.get_sample_value("kvbm_checksum_failures_total", {"model": "m", "tier": "G4"}) == 2
    )


def test_acl_user_and_password_come_from_the_url() -> None:
    """A Redis with the default user off: G4 works with `redis://user:password@host`, and a wrong password is an
    outage (misses, kvbm_redis_up 0), not an error on the request path."""
    server = RedisServer()
    server.start()
    try:
        admin = redis.Redis(port=server.port)
        admin.execute_command("ACL", "SETUSER", "strata", "on", ">s3cret-pw", "~*", "&*", "+@all")
        admin.execute_command("ACL", "SETUSER", "default", "off")
        good = pool_for(f"redis://strata:s3cret-pw@127.0.0.1:{server.port}/0")
        assert good.put([BlockHash(1)], data(1)).stored == [1]
        assert read(good, [1])[0] == [True]
        metrics = KVBMMetrics().for_model("m")
        wrong = pool_for(f"redis://strata:wrong@127.0.0.1:{server.port}/0", metrics=metrics)
        assert read(wrong, [1])[0] == [False]
        assert metrics.registry.get_sample_value("kvbm_redis_up") == 0
    finally:
        server.stop()


def test_a_get_larger_than_one_fetch_chunk_keeps_every_block_in_place(redis_url: str) -> None:
    """Onboarding fetches in chunks (verifying one while the next is in flight): results stay per block."""
    pool = pool_for(redis_url)
    count = 2 * FETCH_CHUNK_BLOCKS + 3
    blocks = data(count, seed=5)
    hashes = [BlockHash(100 + i) for i in range(count)]
    pool.put(hashes, blocks)
    client = redis.Redis.from_url(redis_url)
    client.delete(pool.key(hashes[FETCH_CHUNK_BLOCKS + 1]))  # a miss in the second chunk
    ok, dests = read(pool, [int(h) for h in hashes])
    assert ok == [i != FETCH_CHUNK_BLOCKS + 1 for i in range(count)]
    assert all(np.array_equal(dests[i], blocks[i]) for i in range(count) if ok[i])


def test_block_macs_bind_key_layout_hash_and_payload() -> None:
    mac = block_mac(BLOCK_KEY, 7, 42, b"payload")
    assert len(mac) == 16
    assert mac != block_mac(bytes(32), 7, 42, b"payload")
    assert mac != block_mac(BLOCK_KEY, 8, 42, b"payload")
    assert mac != block_mac(BLOCK_KEY, 7, 43, b"payload")
    assert mac != block_mac(BLOCK_KEY, 7, 42, b"payloaD")
