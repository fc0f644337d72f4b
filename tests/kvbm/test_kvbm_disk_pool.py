"""G3 disk pool: preallocated slots, index that survives restart, checksums, torn writes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvbm.block_hash import BlockHash
from kvbm.disk_pool import DiskPool, DiskPoolError
from kvbm.metrics import KVBMMetrics

BLOCK = 5000  # not a page multiple: slots are padded to 8 KiB


def data(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(count)]


def read(pool: DiskPool, hashes: list[int]) -> tuple[list[bool], list[np.ndarray]]:
    dests = [np.zeros(BLOCK, np.uint8) for _ in hashes]
    return pool.get([BlockHash(h) for h in hashes], dests), dests


def test_round_trip_and_lru(tmp_path: Path) -> None:
    evicted: list[int] = []
    pool = DiskPool(
        tmp_path, "fp", BLOCK, 4, on_evict=lambda gone: evicted.extend(b.block_hash for b in gone)
    )
    blocks = data(5)
    pool.put([BlockHash(h) for h in range(5)], blocks)
    assert evicted == [0]
    ok, dests = read(pool, [4, 3, 2, 1, 0])
    assert ok == [True, True, True, True, False]
    assert all(np.array_equal(d, blocks[h]) for d, h in zip(dests[:4], [4, 3, 2, 1], strict=True))
    assert (tmp_path / pool.dir.name / "blocks.dat").stat().st_size == 4 * 8192
    pool.close()


def test_index_survives_restart(tmp_path: Path) -> None:
    blocks = data(3, seed=1)
    pool = DiskPool(tmp_path, "fp", BLOCK, 8)
    pool.put([BlockHash(h) for h in (11, 12, 13)], blocks)
    pool.close()
    reopened = DiskPool(tmp_path, "fp", BLOCK, 8)
    assert reopened.hashes() == [11, 12, 13]
    ok, dests = read(reopened, [11, 12, 13])
    assert ok == [True] * 3 and all(np.array_equal(a, b) for a, b in zip(blocks, dests, strict=True))
    reopened.close()


def test_corrupted_file_is_a_miss_and_a_metric(tmp_path: Path) -> None:
    metrics = KVBMMetrics().for_model("m")
    pool = DiskPool(tmp_path, "fp", BLOCK, 8, metrics=metrics)
    pool.put([BlockHash(1), BlockHash(2)], data(2))
    slot = pool._lru.slot(BlockHash(2))
    with open(pool.dir / "blocks.dat", "r+b") as f:
        f.seek(slot * pool.slot_stride + 100)
        f.write(b"\xff\x00\xff")
    ok, _ = read(pool, [1, 2])
    assert ok == [True, False]
    assert pool.contains([BlockHash(2)]) == [False]
    assert (
        metrics.registry.get_sample_value("kvbm_checksum_failures_total", {"model": "m", "tier": "G3"}) == 1
    )
    pool.close()


def test_torn_write_is_never_served(tmp_path: Path) -> None:
    """Payload written but the record never committed (crash between the two writes): not a hit after restart;
    record committed but payload torn: checksum mismatch."""
    pool = DiskPool(tmp_path, "fp", BLOCK, 4)
    pool.put([BlockHash(1)], data(1))
    slot = pool._lru.slot(BlockHash(1))
    pool.close()
    with open(tmp_path / pool.dir.name / "blocks.dat", "r+b") as f:  # half of a rewrite landed
        f.seek(slot * pool.slot_stride)
        f.write(os.urandom(BLOCK // 2))
    reopened = DiskPool(tmp_path, "fp", BLOCK, 4)
    ok, dests = read(reopened, [1])
    assert ok == [False]
    reopened.close()


def test_other_layout_never_reads_these_blocks(tmp_path: Path) -> None:
    pool = DiskPool(tmp_path, "model-a", BLOCK, 4)
    pool.put([BlockHash(1)], data(1))
    pool.close()
    other = DiskPool(tmp_path, "model-b", BLOCK, 4)
    assert other.contains([BlockHash(1)]) == [False]
    assert read(other, [1])[0] == [False]
    other.close()


def test_directory_owned_by_one_process(tmp_path: Path) -> None:
    pool = DiskPool(tmp_path, "fp", BLOCK, 4)
    with pytest.raises(DiskPoolError, match="in use"):
        DiskPool(tmp_path, "fp", BLOCK, 4)
    pool.close()


def test_lru_order_survives_restart(tmp_path: Path) -> None:
    pool = DiskPool(tmp_path, "fp", BLOCK, 3)
    pool.put([BlockHash(h) for h in (1, 2, 3)], data(3))
    read(pool, [1])  # 1 becomes the most recently used
    pool.close()
    reopened = DiskPool(tmp_path, "fp", BLOCK, 3)
    assert reopened.hashes() == [2, 3, 1]
    reopened.put([BlockHash(4)], data(1))
    assert reopened.contains([BlockHash(h) for h in (1, 2, 3, 4)]) == [True, False, True, True]
    reopened.close()
