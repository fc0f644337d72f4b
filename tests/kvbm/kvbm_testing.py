"""Helpers for the KVBM tests: KV pools filled with known data, and worker functions for spawned processes (a
real redis-server on a free port is harness.redis_server.RedisServer)."""

from __future__ import annotations

import socket
import time
from typing import TypeVar

import numpy as np
import torch

from cluster.secret import derive_key
from kvbm.api import KVLayout
from kvbm.signing import BLOCK_KEY_PURPOSE

T = TypeVar("T")

CLUSTER_SECRET = b"test-cluster-secret-0123456789abcdef"
BLOCK_KEY = derive_key(CLUSTER_SECRET, BLOCK_KEY_PURPOSE)  # signs G4 and G5 blocks given CLUSTER_SECRET
ZMTP_SIGNATURE = b"\xff" + bytes(7) + b"\x01\x7f"  # the first 10 bytes libzmq sends on every connection
LEASE_TTL_S = 1.0  # the Redis lease of the tests' workers: a killed one leaves the index once it runs out


def old_style_query(block_hashes: list[int]) -> bytes:
    """A query as the KVBM service's former plain-TCP port read it: u32 count, then u64 hashes (little-endian)."""
    return len(block_hashes).to_bytes(4, "little") + b"".join(h.to_bytes(8, "little") for h in block_hashes)


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    """Every byte the peer sends until it closes the connection (a reset counts as closed); TimeoutError if it
    stays open past `timeout_s`."""
    sock.settimeout(timeout_s)
    received = b""
    try:
        while chunk := sock.recv(1 << 16):
            received += chunk
    except ConnectionResetError:
        return received
    return received


def make_kv_cache(layout: KVLayout, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """A KV pool of the engine's shape filled with known random data."""
    shape = (num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(layout.dtype)


def tier_of(connector, kind: type[T]) -> T:
    """The connector's tier of class `kind` (tests look into its files and counters)."""
    return next(tier for tier in connector.tiers if isinstance(tier, kind))


def small_layout(fingerprint: str = "test-model|fp32|bs4") -> KVLayout:
    """1 KiB blocks: 2 layers x K,V x 4 tokens x 2 heads x 8 dims x fp32."""
    return KVLayout(fingerprint, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def block_digests(kv_cache: torch.Tensor, rows: list[int]) -> list[int]:
    import xxhash

    return [xxhash.xxh3_64_intdigest(kv_cache[row].contiguous().view(torch.uint8).numpy()) for row in rows]


def spawned_offload(
    config_fields: dict, worker_id: str, seed: int, num_blocks: int, done, stay: bool
) -> None:
    """Child process: offload blocks 1..num_blocks from a pool seeded with `seed`, report, optionally stay alive."""
    from kvbm.agent import build_connector
    from kvbm.block_hash import BlockHash
    from kvbm.config import KVBMConfig

    connector = build_connector(
        KVBMConfig(**config_fields, block_key=BLOCK_KEY), worker_id, lease_ttl_s=LEASE_TTL_S
    )
    connector.bind(make_kv_cache(small_layout(), 64, seed), small_layout())
    connector.offload([BlockHash(h) for h in range(1, num_blocks + 1)], list(range(num_blocks)))
    connector.events and connector.events.flush()  # type: ignore[union-attr]
    done.put(worker_id)
    if stay:
        # alive until the test's kill -9, the behaviour under test (the 600 s only end an orphan)
        time.sleep(600)
    connector.close()


def spawned_onboard(config_fields: dict, worker_id: str, num_blocks: int, results) -> None:
    """Child process: look up and onboard blocks 1..num_blocks; report (count, digests, blocks per source tier)."""
    from kvbm.block_hash import BlockHash
    from kvbm.config import KVBMConfig
    from kvbm.connector import KVBMConnector

    connector = KVBMConnector(KVBMConfig(**config_fields, block_key=BLOCK_KEY), worker_id)
    kv_cache = torch.zeros(make_kv_cache(small_layout(), 64).shape)
    connector.bind(kv_cache, small_layout())
    block_hashes = [BlockHash(h) for h in range(1, num_blocks + 1)]
    rows = list(range(num_blocks))
    found = connector.lookup(block_hashes)
    count = connector.onboard(block_hashes[:found], rows[:found])
    registry = connector.metrics.registry
    per_tier = {
        tier: registry.get_sample_value(
            "kvbm_onboard_blocks_total", {"model": connector.metrics.model, "direction": f"{tier}->G1"}
        )
        or 0
        for tier in ("G2", "G3", "G4")
    }
    results.put((count, block_digests(kv_cache, rows[:count]), per_tier))
    connector.close()


def block_for(block_hash: int, block_bytes: int) -> np.ndarray:
    """Payload derived from the hash alone, so any reader can tell whether it got the right bytes."""
    return np.random.default_rng(block_hash).integers(0, 256, block_bytes, dtype=np.uint8)


def spawned_g2_stress(cache_id: str, seed: int, rounds: int, start, results) -> None:
    """Child process: random puts and gets on a small shared G2 (all children begin together at the `start`
    barrier); report (wrong blocks served, hits, seconds spent)."""
    from kvbm.block_hash import BlockHash
    from kvbm.host_pool import HostPool

    block_bytes, rng = 4096, np.random.default_rng(seed)
    pool = HostPool(cache_id, "stress", block_bytes, 32, owner=f"p{seed}")
    wrong = hits = 0
    start.wait(timeout=60)
    began = time.monotonic()
    for _ in range(rounds):
        hashes = [BlockHash(int(h)) for h in rng.integers(1, 100, 8)]
        if rng.random() < 0.5:
            pool.put(hashes, [block_for(h, block_bytes) for h in hashes])
            continue
        dests = [np.zeros(block_bytes, np.uint8) for _ in hashes]
        for block_hash, dest, ok in zip(hashes, dests, pool.get(hashes, dests), strict=True):
            hits += ok
            wrong += ok and not np.array_equal(dest, block_for(block_hash, block_bytes))
    pool.close()
    results.put((wrong, hits, time.monotonic() - began))
