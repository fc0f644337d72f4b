"""Two worker processes (multiprocessing spawn) share blocks through G2 shared memory and through G4 Redis."""

from __future__ import annotations

import multiprocessing

import pytest
from kvbm_testing import (
    block_digests,
    make_kv_cache,
    small_layout,
    spawned_g2_stress,
    spawned_offload,
    spawned_onboard,
)

from kvbm.config import GIB
from kvbm.host_pool import SHM_DIR

SPAWN = multiprocessing.get_context("spawn")
NUM_BLOCKS = 12


def share(writer_config: dict, reader_config: dict) -> tuple[int, list[int], dict]:
    done, results = SPAWN.Queue(), SPAWN.Queue()
    writer = SPAWN.Process(target=spawned_offload, args=(writer_config, "writer", 3, NUM_BLOCKS, done, False))
    writer.start()
    assert done.get(timeout=120) == "writer"
    writer.join(timeout=60)
    reader = SPAWN.Process(target=spawned_onboard, args=(reader_config, "reader", NUM_BLOCKS, results))
    reader.start()
    outcome = results.get(timeout=120)
    reader.join(timeout=60)
    return outcome


@pytest.fixture
def expected() -> list[int]:
    return block_digests(make_kv_cache(small_layout(), 64, seed=3), list(range(NUM_BLOCKS)))


def test_two_processes_share_blocks_through_g2(cache_id: str, expected: list[int]) -> None:
    """The writer exits first, keeping the segment (--kvbm-keep-host-cache); the reader, now the segment's only
    process, finds the blocks and removes it when it closes (it did not ask to keep it)."""
    config = dict(cache_id=cache_id, host_cache_gb=64 * 1024 / GIB)
    count, digests, per_tier = share({**config, "keep_host_cache": True}, config)
    assert count == NUM_BLOCKS and digests == expected
    assert per_tier == {"G2": NUM_BLOCKS, "G3": 0, "G4": 0}
    assert not list(SHM_DIR.glob(f"strata-kvbm-{cache_id}-*"))


def test_two_processes_share_blocks_through_g4(cache_id: str, redis_url: str, expected: list[int]) -> None:
    writer = dict(cache_id=cache_id, host_cache_gb=0, redis_url=redis_url, write_through=True)
    reader = dict(cache_id=cache_id + "-other-node", host_cache_gb=0, redis_url=redis_url)
    count, digests, per_tier = share(writer, reader)
    assert count == NUM_BLOCKS and digests == expected
    assert per_tier == {"G2": 0, "G3": 0, "G4": NUM_BLOCKS}


def test_concurrent_processes_never_read_wrong_bytes_from_g2(cache_id: str) -> None:
    """Both processes hammer one 32-slot segment at once (random puts and gets of 100 hashes)."""
    results, start = SPAWN.Queue(), SPAWN.Barrier(2)
    workers = [
        SPAWN.Process(target=spawned_g2_stress, args=(cache_id, seed, 3000, start, results))
        for seed in (1, 2)
    ]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
    assert [wrong for wrong, _, _ in outcomes] == [0, 0]
    assert all(hits > 100 for _, hits, _ in outcomes), outcomes
