"""A graceful close of the KVBM agent: G2 blocks reach G3, the node's G2 segment is removed by the last process
that maps it (unless kept), and what kill -9 leaves behind is cleaned up by the next process that opens it."""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
from kvbm_testing import make_kv_cache, small_layout, spawned_offload, tier_of

import kvbm.connector as connector_module
import kvbm.host_pool as host_pool_module
from kvbm.api import KVLayout
from kvbm.block_hash import BlockHash
from kvbm.config import GIB, KVBMConfig
from kvbm.connector import KVBMConnector
from kvbm.disk_pool import DiskPool
from kvbm.host_pool import SHM_DIR, HostPool, _lock_users
from kvbm.index import KVIndex

NUM_BLOCKS = 64
SPAWN = multiprocessing.get_context("spawn")


def gb(blocks: int, layout: KVLayout) -> float:
    return blocks * layout.block_bytes / GIB


def connector(
    layout: KVLayout, cache_id: str, worker_id: str = "worker-0", seed: int = 0, **config
) -> tuple[KVBMConnector, torch.Tensor]:
    kv_cache = make_kv_cache(layout, NUM_BLOCKS, seed)
    config.setdefault("host_cache_gb", gb(16, layout))
    kvbm = KVBMConnector(KVBMConfig(cache_id=cache_id, **config), worker_id, events=KVIndex())
    kvbm.bind(kv_cache, layout)
    return kvbm, kv_cache


def hashes(count: int, start: int = 1) -> list[BlockHash]:
    return [BlockHash(start + i) for i in range(count)]


def segments(cache_id: str) -> list[Path]:
    return list(SHM_DIR.glob(f"strata-kvbm-{cache_id}-*"))


def sample(kvbm: KVBMConnector, name: str, **labels: str) -> float:
    return kvbm.metrics.registry.get_sample_value(name, {"model": kvbm.metrics.model, **labels}) or 0.0


def test_close_flushes_g2_to_g3_and_a_fresh_connector_onboards_them(
    cache_id: str, tmp_path: Path, layout
) -> None:
    disk = dict(disk_cache_gb=gb(32, layout), disk_path=tmp_path)
    first, kv_cache = connector(layout, cache_id, **disk)
    original = kv_cache[:8].clone()
    first.offload(hashes(8), list(range(8)))
    assert tier_of(first, DiskPool).used_blocks == 0  # all 8 fit in G2: nothing was spilled
    first.close()
    assert sample(first, "kvbm_offload_blocks_total", direction="G2->G3") == 8
    assert not segments(cache_id)

    restarted, restarted_cache = connector(layout, cache_id, seed=5, **disk)
    assert restarted.events.query(hashes(8)).workers["worker-0"].g3 == 8  # announced at bind
    assert restarted.lookup(hashes(8)) == 8
    rows = list(range(40, 48))
    assert restarted.onboard(hashes(8), rows) == 8
    assert all(torch.equal(restarted_cache[row], original[i]) for i, row in enumerate(rows))
    assert sample(restarted, "kvbm_onboard_blocks_total", direction="G3->G1") == 8
    restarted.close()


def test_segment_is_removed_on_close_unless_kept(cache_id: str, layout) -> None:
    plain, _ = connector(layout, cache_id)
    assert len(segments(cache_id)) == 1
    plain.close()
    assert not segments(cache_id)

    kept, kv_cache = connector(layout, cache_id, keep_host_cache=True)
    original = kv_cache[:4].clone()
    kept.offload(hashes(4), [0, 1, 2, 3])
    kept.close()
    assert len(segments(cache_id)) == 1
    restarted, restarted_cache = connector(layout, cache_id, seed=5)  # this one does not keep it
    assert restarted.onboard(hashes(4), [40, 41, 42, 43]) == 4
    assert torch.equal(restarted_cache[40:44], original)
    assert sample(restarted, "kvbm_onboard_blocks_total", direction="G2->G1") == 4
    restarted.close()
    assert not segments(cache_id)


def test_each_process_flushes_its_own_blocks_and_the_last_removes_the_segment(
    cache_id: str, tmp_path: Path, layout
) -> None:
    disk = dict(disk_cache_gb=gb(16, layout), disk_path=tmp_path)
    first, _ = connector(layout, cache_id, "a", **disk)
    second, _ = connector(layout, cache_id, "b", seed=1, **disk)
    first.offload(hashes(4), [0, 1, 2, 3])
    second.offload(hashes(4, start=11), [0, 1, 2, 3])
    first.close()
    assert sorted(tier_of(first, DiskPool).hashes()) == hashes(4)
    assert len(segments(cache_id)) == 1  # "b" still maps it
    assert second.onboard(hashes(4), [40, 41, 42, 43]) == 4  # from G2, still there
    second.close()
    assert sorted(tier_of(second, DiskPool).hashes()) == hashes(4, start=11)  # "a" copied its own already
    assert not segments(cache_id)


def test_last_process_also_flushes_blocks_whose_owner_left_without_doing_so(
    cache_id: str, tmp_path: Path, layout
) -> None:
    left = HostPool(cache_id, layout.fingerprint, layout.block_bytes, 16, owner="killed-worker")
    left.put(hashes(3, start=21), [np.full(layout.block_bytes, 7, np.uint8)] * 3)
    last, _ = connector(layout, cache_id, "b", disk_cache_gb=gb(16, layout), disk_path=tmp_path)
    left.close()  # no flush: as if the process had been killed
    last.offload(hashes(2), [0, 1])
    last.close()
    assert sorted(tier_of(last, DiskPool).hashes()) == hashes(2) + hashes(3, start=21)
    assert not segments(cache_id)


def test_g3_smaller_than_g2_keeps_the_hottest_blocks(cache_id: str, tmp_path: Path, layout) -> None:
    kvbm, _ = connector(layout, cache_id, disk_cache_gb=gb(4, layout), disk_path=tmp_path)
    kvbm.offload(hashes(12), list(range(12)))
    kvbm.onboard(hashes(4, start=5), [40, 41, 42, 43])  # blocks 5..8 are the most recently used
    kvbm.close()
    assert sorted(tier_of(kvbm, DiskPool).hashes()) == hashes(4, start=5)


def test_spent_flush_budget_stops_the_copy_and_still_removes_the_segment(
    cache_id: str, tmp_path: Path, layout, caplog
) -> None:
    kvbm, _ = connector(
        layout, cache_id, disk_cache_gb=gb(16, layout), disk_path=tmp_path, flush_budget_s=1e-9
    )
    kvbm.offload(hashes(8), list(range(8)))
    with caplog.at_level(logging.WARNING, logger="kvbm.connector"):
        kvbm.close()
    assert tier_of(kvbm, DiskPool).used_blocks == 0
    assert "8 colder G2 blocks not copied to G3" in caplog.text
    assert not segments(cache_id)


class StepClock:
    """kvbm.connector's `time` in a test: monotonic() advances one second per call."""

    def __init__(self) -> None:
        self.now = 0.0
        self.perf_counter = time.perf_counter

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now


def test_a_budget_spent_midway_has_copied_the_hottest_blocks(
    cache_id: str, tmp_path: Path, layout, monkeypatch
) -> None:
    monkeypatch.setattr(connector_module, "FLUSH_BATCH", 2)
    monkeypatch.setattr(connector_module, "time", StepClock())
    # deadline = 1 s (when taken) + 1.5 s; batches are checked at 2 s (copied), 3 s (stop): one batch of 2
    kvbm, _ = connector(
        layout, cache_id, disk_cache_gb=gb(16, layout), disk_path=tmp_path, flush_budget_s=1.5
    )
    kvbm.offload(hashes(8), list(range(8)))
    kvbm.onboard([BlockHash(3), BlockHash(6)], [40, 41])  # 6 is the hottest, then 3
    kvbm.close()
    assert sorted(tier_of(kvbm, DiskPool).hashes()) == [3, 6]


def test_after_kill_9_the_next_process_reuses_the_segment_and_clears_stale_pins(cache_id: str) -> None:
    layout = small_layout()
    config = dict(cache_id=cache_id, host_cache_gb=gb(64, layout))
    done = SPAWN.Queue()
    writer = SPAWN.Process(target=spawned_offload, args=(config, "writer", 3, 12, done, True))
    writer.start()
    try:
        assert done.get(timeout=120) == "writer"
        handle = HostPool(cache_id, layout.fingerprint, layout.block_bytes, 64)
        handle._slots["pins"][:] = 1  # as if the writer had died in the middle of onboarding every block
        handle.close()
        assert len(segments(cache_id)) == 1  # the writer still maps it
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(30)
    finally:
        if writer.is_alive():
            writer.kill()
    reader, _ = connector(layout, cache_id, "reader", host_cache_gb=gb(64, layout))
    assert int(tier_of(reader, HostPool)._slots["pins"].sum()) == 0
    assert reader.lookup(hashes(12)) == 12  # the killed writer's blocks are still served
    reader.close()
    assert not segments(cache_id)


def test_a_process_opening_while_the_last_one_removes_the_segment_gets_a_fresh_one(
    cache_id: str, monkeypatch
) -> None:
    """The opener has the old segment file open and waits for its users lock when the last user unlinks it:
    once it gets the lock it must drop that file for a fresh one, not map the removed segment."""
    block = np.zeros(64, np.uint8)
    closing = HostPool(cache_id, "fp", 64, 16)
    closing.put(hashes(2), [block, block])
    assert closing.leave()  # the only process: it holds the segment until it is removed
    waiting = threading.Event()

    def lock_users(fd: int, kind: int, wait: bool = False) -> bool:
        if wait:
            waiting.set()  # the opener has the old file open and is about to block on the lock `closing` holds
        return _lock_users(fd, kind, wait)

    monkeypatch.setattr(host_pool_module, "_lock_users", lock_users)
    opened: list[HostPool] = []
    opener = threading.Thread(target=lambda: opened.append(HostPool(cache_id, "fp", 64, 16)))
    opener.start()
    assert waiting.wait(10)
    closing.destroy()
    opener.join(10)
    assert not opener.is_alive()
    fresh = opened[0]
    assert fresh.contains(hashes(2)) == [False, False] and fresh.path.exists()
    fresh.destroy()
    assert not segments(cache_id)


def test_of_two_users_leaving_at_once_only_the_one_that_removes_the_segment_is_last(cache_id: str) -> None:
    first, second = HostPool(cache_id, "fp", 64, 16), HostPool(cache_id, "fp", 64, 16)
    _lock_users(second._fd, fcntl.F_UNLCK)  # the second has begun to leave ...
    assert first.leave()  # ... so the first finds itself alone
    first.destroy()
    assert not second.leave()  # it is alone now too, but the segment it mapped is gone: not the last user
    second.close()
    assert not segments(cache_id)
