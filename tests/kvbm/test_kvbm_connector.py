"""KVBMConnector over real tiers with a KV pool of the engine's layout filled with known data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kvbm_testing import BLOCK_KEY, make_kv_cache, small_layout, tier_of
from msgspec.structs import replace

from cluster.redis_link import MAX_BACKOFF_S
from harness.redis_server import RedisServer
from harness.waiting import wait_for
from kvbm.api import BlockRemoved, BlockStored, KVLayout
from kvbm.block_hash import BlockHash
from kvbm.config import GIB, KVBMConfig
from kvbm.connector import KVBMConnector
from kvbm.disk_pool import DiskPool
from kvbm.host_pool import HostPool
from kvbm.index import KVIndex
from kvbm.metrics import KVBMMetrics
from kvbm.redis_pool import RedisPool

NUM_BLOCKS = 64


def gb(blocks: int, layout: KVLayout) -> float:
    return blocks * layout.block_bytes / GIB


def connector(layout: KVLayout, cache_id: str, seed: int = 0, **config) -> tuple[KVBMConnector, torch.Tensor]:
    kv_cache = make_kv_cache(layout, NUM_BLOCKS, seed)
    config.setdefault("host_cache_gb", gb(16, layout))
    kvbm = KVBMConnector(
        KVBMConfig(cache_id=cache_id, block_key=BLOCK_KEY, **config), metrics=KVBMMetrics(), events=KVIndex()
    )
    kvbm.bind(kv_cache, layout)
    return kvbm, kv_cache


def hashes(count: int, start: int = 1) -> list[BlockHash]:
    return [BlockHash(start + i) for i in range(count)]


def onboarded(
    kvbm: KVBMConnector, kv_cache: torch.Tensor, block_hashes: list[BlockHash], original: torch.Tensor
):
    """Onboard into the upper half of the pool (zeroed first); return (count, rows equal to the originals)."""
    rows = list(range(NUM_BLOCKS // 2, NUM_BLOCKS // 2 + len(block_hashes)))
    kv_cache[rows] = 0
    count = kvbm.onboard(block_hashes, rows)
    same = [torch.equal(kv_cache[row], original[i]) for i, row in enumerate(rows)]
    return count, same


def sample(kvbm: KVBMConnector, name: str, **labels: str) -> float:
    return kvbm.metrics.registry.get_sample_value(name, {"model": kvbm.metrics.model, **labels}) or 0.0


def test_models_sharing_a_registry_keep_their_own_series(cache_id: str, layout) -> None:
    """The frontend's engines share one registry: each model's tier series carry its `model` label."""
    metrics = KVBMMetrics()
    config = KVBMConfig(cache_id=cache_id, host_cache_gb=gb(16, layout))
    a = KVBMConnector(config, "a-0", metrics, KVIndex(), model="a")
    a.bind(make_kv_cache(layout, NUM_BLOCKS), layout)
    b = KVBMConnector(replace(config, host_cache_gb=0.0), "b-0", metrics, KVIndex(), model="b")
    b.bind(make_kv_cache(layout, NUM_BLOCKS // 2), layout)
    a.offload(hashes(4), list(range(4)))
    assert a.lookup(hashes(4)) == 4 and b.lookup(hashes(4)) == 0

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert value("kvbm_tier_blocks_capacity", model="a", tier="G1") == NUM_BLOCKS
    assert value("kvbm_tier_blocks_capacity", model="b", tier="G1") == NUM_BLOCKS // 2
    assert value("kvbm_hits_total", model="a", tier="G2") == 4
    assert value("kvbm_hits_total", model="b", tier="G2") is None  # b has no G2
    assert value("kvbm_offload_blocks_total", model="a", direction="G1->G2") == 4
    a.close()
    b.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_g2_round_trip_is_byte_identical(cache_id: str, dtype: torch.dtype) -> None:
    layout = KVLayout(f"m|{dtype}", 2, 4, 2, 8, dtype)
    kvbm, kv_cache = connector(layout, cache_id)
    block_hashes = hashes(8)
    original = kv_cache[:8].clone()
    kvbm.offload(block_hashes, list(range(8)))
    assert kvbm.lookup(block_hashes + [BlockHash(999)]) == 8
    assert onboarded(kvbm, kv_cache, block_hashes, original) == (8, [True] * 8)
    assert sample(kvbm, "kvbm_onboard_blocks_total", direction="G2->G1") == 8
    kvbm.close()


def test_g2_eviction_spills_to_g3_and_onboard_reads_both(cache_id: str, tmp_path: Path, layout) -> None:
    kvbm, kv_cache = connector(layout, cache_id, disk_cache_gb=gb(32, layout), disk_path=tmp_path)
    block_hashes = hashes(24)
    original = kv_cache[:24].clone()
    for start in range(0, 24, 4):  # evictions come a few blocks at a time
        kvbm.offload(block_hashes[start : start + 4], list(range(start, start + 4)))
    assert tier_of(kvbm, HostPool).used_blocks == 16 and tier_of(kvbm, DiskPool).used_blocks == 8
    assert kvbm.lookup(block_hashes) == 24
    assert onboarded(kvbm, kv_cache, block_hashes, original) == (24, [True] * 24)
    assert sample(kvbm, "kvbm_onboard_blocks_total", direction="G3->G1") == 8
    assert sample(kvbm, "kvbm_offload_blocks_total", direction="G2->G3") == 8
    kvbm.close()


def test_batch_larger_than_g2_overflows_to_g3(cache_id: str, tmp_path: Path, layout) -> None:
    kvbm, kv_cache = connector(layout, cache_id, disk_cache_gb=gb(32, layout), disk_path=tmp_path)
    original = kv_cache[:24].clone()
    kvbm.offload(hashes(24), list(range(24)))
    assert tier_of(kvbm, HostPool).used_blocks == 16 and tier_of(kvbm, DiskPool).used_blocks == 8
    assert onboarded(kvbm, kv_cache, hashes(24), original) == (24, [True] * 24)
    kvbm.close()


def test_disk_min_uses_keeps_single_use_blocks_off_disk(cache_id: str, tmp_path: Path, layout) -> None:
    kvbm, _ = connector(layout, cache_id, disk_cache_gb=gb(32, layout), disk_path=tmp_path, disk_min_uses=2)
    kvbm.offload(hashes(16), list(range(16)))
    kvbm.onboard(hashes(4), [40, 41, 42, 43])  # blocks 1..4 used twice
    kvbm.offload(hashes(16, start=101), list(range(16)))
    assert sorted(tier_of(kvbm, DiskPool).hashes()) == hashes(4)
    kvbm.close()


def test_g4_write_through_round_trip(cache_id: str, redis_url: str, layout) -> None:
    writer, kv_cache = connector(layout, cache_id, redis_url=redis_url, write_through=True)
    block_hashes = hashes(8)
    original = kv_cache[:8].clone()
    writer.offload(block_hashes, list(range(8)))
    writer.close()
    reader, reader_cache = connector(layout, cache_id + "x", seed=1, host_cache_gb=0, redis_url=redis_url)
    assert reader.lookup(block_hashes) == 8
    assert onboarded(reader, reader_cache, block_hashes, original) == (8, [True] * 8)
    assert sample(reader, "kvbm_onboard_blocks_total", direction="G4->G1") == 8
    reader.close()


def test_onboard_takes_each_block_from_fastest_tier(
    cache_id: str, tmp_path: Path, redis_url: str, layout
) -> None:
    kvbm, kv_cache = connector(
        layout,
        cache_id,
        disk_cache_gb=gb(8, layout),
        disk_path=tmp_path,
        redis_url=redis_url,
        write_through=True,
    )
    block_hashes = hashes(30)
    original = kv_cache[:30].clone()
    kvbm.offload(block_hashes, list(range(30)))  # G2 keeps 16, G3 the 8 latest spills, G4 all 30
    assert onboarded(kvbm, kv_cache, block_hashes, original) == (30, [True] * 30)
    per_tier = [sample(kvbm, "kvbm_onboard_blocks_total", direction=f"G{t}->G1") for t in (2, 3, 4)]
    assert per_tier == [16, 8, 6]
    kvbm.close()


def test_lookup_stops_at_first_missing_block(cache_id: str, layout) -> None:
    kvbm, _ = connector(layout, cache_id)
    kvbm.offload([BlockHash(1), BlockHash(2), BlockHash(4)], [0, 1, 3])
    assert kvbm.lookup(hashes(4)) == 2
    assert kvbm.lookup([BlockHash(9)] + hashes(2)) == 0
    kvbm.close()


def test_different_layout_never_reads_another_layouts_blocks(
    cache_id: str, tmp_path: Path, redis_url: str
) -> None:
    config = dict(
        disk_cache_gb=gb(8, small_layout()), disk_path=tmp_path, redis_url=redis_url, write_through=True
    )
    one, _ = connector(small_layout("model-a"), cache_id, **config)
    one.offload(hashes(20), list(range(20)))
    one.close()
    two, _ = connector(small_layout("model-b"), cache_id, **config)
    assert two.lookup(hashes(20)) == 0
    assert two.onboard(hashes(4), [40, 41, 42, 43]) == 0
    two.close()


def test_events_feed_the_embedded_index(cache_id: str, tmp_path: Path, layout) -> None:
    kvbm, _ = connector(layout, cache_id, disk_cache_gb=gb(8, layout), disk_path=tmp_path)
    index: KVIndex = kvbm.events  # type: ignore[assignment]
    block_hashes = hashes(20)
    for block_hash in block_hashes[:4]:
        kvbm.on_event(BlockStored(block_hash, None, (1, 2, 3, 4)))
    for start in range(0, 20, 4):
        kvbm.offload(block_hashes[start : start + 4], list(range(start, start + 4)))
    report = index.query(block_hashes)
    assert report.workers["worker-0"].g1 == 4
    kvbm.on_event(BlockRemoved(tuple(block_hashes[:4])))
    report = index.query(block_hashes)
    prefix = report.workers["worker-0"]
    assert (prefix.g1, prefix.g3) == (0, 20)  # the 4 earliest went G2 -> G3, so G2 alone is not a prefix
    assert index.query(block_hashes[4:]).workers["worker-0"].g2 == 16
    kvbm.close()


def test_redis_outage_keeps_g2_g3_working(cache_id: str, tmp_path: Path, layout) -> None:
    server = RedisServer()
    server.start()
    try:
        kvbm, kv_cache = connector(
            layout,
            cache_id,
            disk_cache_gb=gb(32, layout),
            disk_path=tmp_path,
            redis_url=server.url,
            write_through=True,
        )
        original = kv_cache[:24].clone()
        server.stop()
        kvbm.offload(hashes(24), list(range(24)))
        assert kvbm.lookup(hashes(24)) == 24
        assert onboarded(kvbm, kv_cache, hashes(24), original) == (24, [True] * 24)
        server.start()
        g2, g4 = tier_of(kvbm, HostPool), tier_of(kvbm, RedisPool)

        def written_through() -> bool:
            kvbm.offload([BlockHash(100)], [0])
            g2.evict(16)  # force the next offload to really write again
            return g4.contains([BlockHash(100)])[0]

        # Redis is another process: polling a write is the only way to see it back; the link tries once per
        # backoff period (at most MAX_BACKOFF_S), so twice that bounds the wait
        wait_for(written_through, 2 * MAX_BACKOFF_S, what="G4 to take a write-through again")
        kvbm.close()
    finally:
        server.stop()


def test_metrics_cover_tiers_transfers_and_hits(cache_id: str, tmp_path: Path, layout) -> None:
    kvbm, _ = connector(layout, cache_id, disk_cache_gb=gb(8, layout), disk_path=tmp_path)
    kvbm.on_event(BlockStored(BlockHash(1), None, (1, 2, 3, 4)))
    kvbm.offload(hashes(4), [0, 1, 2, 3])
    kvbm.lookup(hashes(5))
    kvbm.onboard(hashes(4), [40, 41, 42, 43])
    bb = layout.block_bytes
    assert sample(kvbm, "kvbm_tier_blocks_capacity", tier="G2") == 16
    assert sample(kvbm, "kvbm_tier_bytes_capacity", tier="G3") == 8 * bb
    assert sample(kvbm, "kvbm_tier_blocks_used", tier="G2") == 4
    assert sample(kvbm, "kvbm_tier_blocks_used", tier="G1") == 1
    assert sample(kvbm, "kvbm_hits_total", tier="G2") == 4
    assert sample(kvbm, "kvbm_misses_total", tier="G3") == 1
    assert sample(kvbm, "kvbm_transfer_bytes_total", direction="G1->G2") == 4 * bb
    assert sample(kvbm, "kvbm_transfer_seconds_count", direction="G2->G1") == 1
    kvbm.close()


def test_corrupt_g3_block_is_taken_from_g4_instead(
    cache_id: str, tmp_path: Path, redis_url: str, layout
) -> None:
    kvbm, kv_cache = connector(
        layout, cache_id, host_cache_gb=0, disk_cache_gb=gb(8, layout), disk_path=tmp_path, redis_url=redis_url,
        write_through=True,
    )  # fmt: skip
    original = kv_cache[:4].clone()
    kvbm.offload(hashes(4), [0, 1, 2, 3])
    disk = tier_of(kvbm, DiskPool)
    slot = disk._lru.slot(BlockHash(2))
    with open(disk.dir / "blocks.dat", "r+b") as blocks_file:
        blocks_file.seek(slot * disk.slot_stride + 8)
        blocks_file.write(b"\x00\x01\x02\x03")
    assert onboarded(kvbm, kv_cache, hashes(4), original) == (4, [True] * 4)
    assert sample(kvbm, "kvbm_checksum_failures_total", tier="G3") == 1
    assert sample(kvbm, "kvbm_onboard_blocks_total", direction="G4->G1") == 1
    kvbm.close()


def test_restarted_worker_finds_its_disk_blocks_and_announces_them(
    cache_id: str, tmp_path: Path, layout
) -> None:
    config = dict(host_cache_gb=0, disk_cache_gb=gb(8, layout), disk_path=tmp_path)
    first, kv_cache = connector(layout, cache_id, **config)
    original = kv_cache[:4].clone()
    first.offload(hashes(4), [0, 1, 2, 3])
    first.close()
    restarted, restarted_cache = connector(layout, cache_id, seed=5, **config)
    assert restarted.events.query(hashes(4)).workers["worker-0"].g3 == 4  # announced at bind
    assert onboarded(restarted, restarted_cache, hashes(4), original) == (4, [True] * 4)
    restarted.close()


def test_workers_sharing_a_g2_segment_are_all_credited(cache_id: str, layout) -> None:
    index = KVIndex()
    writer = KVBMConnector(
        KVBMConfig(cache_id=cache_id, host_cache_gb=gb(16, layout)), "writer", events=index
    )
    reader = KVBMConnector(
        KVBMConfig(cache_id=cache_id, host_cache_gb=gb(16, layout)), "reader", events=index
    )
    writer.bind(make_kv_cache(layout, NUM_BLOCKS), layout)
    reader.bind(make_kv_cache(layout, NUM_BLOCKS, seed=1), layout)
    writer.offload(hashes(4), [0, 1, 2, 3])
    report = index.query(hashes(4))
    assert report.workers["writer"].g2 == report.workers["reader"].g2 == 4
    writer.close()
    reader.close()


def test_config_travels_as_json_to_a_worker_under_another_python(tmp_path):
    """KVBMConfig.to_json/from_json: what a vLLM worker's StrataKVConnector is built from."""
    config = KVBMConfig(
        host_cache_gb=0.5, disk_cache_gb=1.0, disk_path=tmp_path / "kv", redis_url="redis://127.0.0.1:1",
        block_key=BLOCK_KEY, cache_id="node-a", write_through=True,
    )  # fmt: skip
    again = KVBMConfig.from_json(json.loads(json.dumps(config.to_json())))
    assert again == config
    assert KVBMConfig.from_json({**config.to_json(), "redis_url": None, "block_key": None}).block_key is None
    with pytest.raises(
        ValueError, match="redis_url"
    ):  # G4 without its key is refused, as on the command line
        KVBMConfig.from_json({**config.to_json(), "block_key": None})
