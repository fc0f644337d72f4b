"""G2 host pool: shared-memory slots, set-associative LRU, pins, eviction callback."""

from __future__ import annotations

import numpy as np
import pytest

from kvbm.block_hash import BlockHash
from kvbm.host_pool import HostPool
from kvbm.tier import PutResult

BLOCK = 1000  # bytes, deliberately not a page multiple


def blocks(values: range) -> list[np.ndarray]:
    return [np.full(BLOCK, v % 256, dtype=np.uint8) for v in values]


def test_round_trip_is_byte_identical(cache_id: str) -> None:
    pool = HostPool(cache_id, "fp", BLOCK, 16)
    data = [np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8) for i in range(10)]
    hashes = [BlockHash(1000 + i) for i in range(10)]
    assert pool.put(hashes, data) == PutResult(stored=hashes)
    dests = [np.zeros(BLOCK, np.uint8) for _ in range(10)]
    assert pool.get(hashes, dests) == [True] * 10
    assert all(np.array_equal(a, b) for a, b in zip(data, dests, strict=True))
    assert pool.used_blocks == 10
    pool.destroy()


def test_lru_evicts_least_recently_used_and_spills_intact_payload(cache_id: str) -> None:
    spilled: list[tuple[int, int, int]] = []
    pool = HostPool(cache_id, "fp", BLOCK, 4, owner="w0")
    pool.on_evict = lambda evicted: spilled.extend((e.block_hash, int(e.payload[0]), e.uses) for e in evicted)
    pool.put([BlockHash(h) for h in range(4)], blocks(range(4)))
    pool.get([BlockHash(0)], [np.zeros(BLOCK, np.uint8)])  # 0 becomes most recent, used twice
    pool.put([BlockHash(10)], blocks(range(10, 11)))
    assert spilled == [(1, 1, 1)]
    assert pool.contains([BlockHash(h) for h in (0, 1, 2, 3, 10)]) == [True, False, True, True, True]
    pool.destroy()


def test_pinned_block_is_never_evicted(cache_id: str) -> None:
    pool = HostPool(cache_id, "fp", BLOCK, 2)
    pool.put([BlockHash(1), BlockHash(2)], blocks(range(1, 3)))
    pool._slots["pins"][:] = 1  # as if two onboards were in flight
    assert pool.put([BlockHash(3)], blocks(range(3, 4))) == PutResult(rejected=[0])
    assert pool.contains([BlockHash(1), BlockHash(2)]) == [True, True]
    pool._slots["pins"][:] = 0
    assert pool.put([BlockHash(3)], blocks(range(3, 4))) == PutResult(stored=[BlockHash(3)])
    pool.destroy()


def test_two_handles_share_one_segment(cache_id: str) -> None:
    writer = HostPool(cache_id, "fp", BLOCK, 8, owner="a")
    reader = HostPool(cache_id, "fp", BLOCK, 8, owner="b")
    writer.put([BlockHash(7)], blocks(range(7, 8)))
    dest = np.zeros(BLOCK, np.uint8)
    assert reader.get([BlockHash(7)], [dest]) == [True] and dest[0] == 7
    assert reader.owned_hashes("a") == [7] and reader.owned_hashes("b") == []
    reader.close()
    writer.destroy()


def test_other_layout_gets_another_segment(cache_id: str) -> None:
    one = HostPool(cache_id, "model-a", BLOCK, 8)
    two = HostPool(cache_id, "model-b", BLOCK, 8)
    one.put([BlockHash(5)], blocks(range(5, 6)))
    assert one.path != two.path
    assert two.contains([BlockHash(5)]) == [False]
    one.destroy()
    two.destroy()


def test_evict_returns_oldest(cache_id: str) -> None:
    pool = HostPool(cache_id, "fp", BLOCK, 8)
    pool.put([BlockHash(h) for h in (1, 2, 3)], blocks(range(3)))
    assert pool.evict(2) == [1, 2]
    assert pool.contains([BlockHash(h) for h in (1, 2, 3)]) == [False, False, True]
    pool.destroy()


def test_failed_spill_leaves_no_slot_stuck(cache_id: str) -> None:
    pool = HostPool(cache_id, "fp", BLOCK, 1)
    pool.put([BlockHash(1)], blocks(range(1)))

    def broken_spill(_evicted) -> None:
        raise OSError("disk gone")

    pool.on_evict = broken_spill
    with pytest.raises(OSError):
        pool.put([BlockHash(2)], blocks(range(1)))
    pool.on_evict = None
    assert pool.contains([BlockHash(2)]) == [False]
    assert pool.put([BlockHash(3)], blocks(range(1))).stored == [3]
    pool.destroy()


@pytest.mark.parametrize("seed", range(5))
def test_prefixes_filling_two_thirds_of_the_pool_stay_whole(cache_id: str, seed: int) -> None:
    """Each hash may take a slot in either of two sets: at 2/3 occupancy no set overflows, so no block is evicted
    from the middle of a cached prefix (with one set per hash, 3 of 5 seeds here lost a chain's middle)."""
    rng = np.random.default_rng(seed)
    chains = [[BlockHash(int(h)) for h in rng.integers(0, 2**63, 69)] for _ in range(5)]
    pool = HostPool(cache_id, "fp", 64, 512)
    for chain in chains:
        assert pool.put(chain, [np.zeros(64, np.uint8)] * len(chain)).rejected == []
    assert all(pool.contains(chain) == [True] * len(chain) for chain in chains)
    pool.destroy()
