"""`KVBMConnector`: the engine's KVConnector over G2 host shm, G3 disk and G4 Redis (the per-worker KVBM agent).

Policies:
  offload   G1 eviction -> G2 (or G3 when there is no G2, or G4 when there is no local tier); blocks G2 has
            no room for (every way of their set pinned or claimed by the same batch) go straight to G3;
            with `write_through` every offloaded block is also written to G4.
  spill     a block G2 evicts goes to G3 if it was used at least `disk_min_uses` times, else it is dropped.
  onboard   one batched transfer per tier, fastest first (G2 memcpy, G3 preadv of consecutive slots, G4 one
            MGET pipeline), each tier asked only for the blocks no faster tier delivered, so a block missing or
            corrupt in G3 still comes from G4; the engine gets the leading run of valid blocks.
  lookup    the leading run of blocks some tier holds (G2 headers, G3 in-memory index, G4 one EXISTS pipeline).
Events: every change of what this worker holds (G1 from the engine's events, G2/G3/G4 from the tiers) is
published to `events` (the embedded `KVIndex`, a transport to the server's index, or the Redis Stream channel)
as `TierEvent`s; G2 events name the node's segment so every worker mapping it is credited.
Device pools: CPU only here. On CUDA, G2 would be registered pinned host memory and each tier's transfer would
land in a pinned staging buffer copied to the device rows with one batched cudaMemcpyAsync.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kvbm.api import BlockEvent, BlockRemoved, BlockStored, KVLayout
from kvbm.block_hash import BlockHash
from kvbm.config import KVBMConfig
from kvbm.disk_pool import DiskPool
from kvbm.events import G1, G2, G3, G4, EventSink, TierEvent
from kvbm.host_pool import SHM_DIR, EvictedBlock, HostPool
from kvbm.metrics import KVBMMetrics
from kvbm.redis_link import RedisLink
from kvbm.redis_pool import RedisPool
from kvbm.tier import BlockTier

log = logging.getLogger(__name__)


def block_rows(kv_cache: torch.Tensor, num_blocks: int) -> np.ndarray:
    """[num_blocks, block_bytes] uint8 numpy view sharing memory with the engine's KV pool."""
    if kv_cache.device.type != "cpu":
        raise ValueError(
            f"KVBMConnector supports CPU KV pools only (got {kv_cache.device}); a device pool needs a pinned host"
            " staging buffer, not built yet: run the engine without --kvbm-* flags on GPUs"
        )
    if not kv_cache.is_contiguous():
        raise ValueError(
            "KVBMConnector.bind: kv_cache must be contiguous (block-major layout, see kvbm/api.py)"
        )
    return kv_cache.view(torch.uint8).reshape(num_blocks, -1).numpy()


def _file_name(worker_id: str) -> str:
    """A worker's G3 directory name: each worker owns its disk cache (G2 is the node-shared tier)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", worker_id) or "worker"


class KVBMConnector:
    """Implements `kvbm.api.KVConnector`. All calls come from the engine thread."""

    def __init__(
        self,
        config: KVBMConfig,
        worker_id: str = "worker-0",
        metrics: KVBMMetrics | None = None,
        events: EventSink | None = None,
        shm_dir: Path = SHM_DIR,
    ) -> None:
        config.validate()
        self.config = config
        self.worker_id = worker_id
        self.metrics = metrics if metrics is not None else KVBMMetrics()
        self.events = events
        self.shm_dir = shm_dir
        self.g2: HostPool | None = None
        self.g3: DiskPool | None = None
        self.g4: RedisPool | None = None
        self._g1: set[BlockHash] = set()
        self._announce_due = False  # set from other threads, served on the engine thread
        self.node = ""  # the G2 segment this worker shares with the others on its host (index events name it)

    @property
    def tiers(self) -> list[BlockTier]:
        """Configured tiers below G1, fastest first."""
        return [tier for tier in (self.g2, self.g3, self.g4) if tier is not None]

    def bind(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self._rows = block_rows(kv_cache, kv_cache.shape[0])
        cfg, bb = self.config, self.block_bytes
        self.g2 = self._open_host_pool() if cfg.capacity_blocks(cfg.host_cache_gb, bb) > 0 else None
        self.g3 = self._open_disk_pool() if cfg.capacity_blocks(cfg.disk_cache_gb, bb) > 0 else None
        self.g4 = self._open_redis_pool() if cfg.redis_url else None
        self.node = f"{socket.gethostname()}:{self.g2.path.name}" if self.g2 is not None else ""
        if (cfg.host_cache_gb > 0 and self.g2 is None) or (cfg.disk_cache_gb > 0 and self.g3 is None):
            log.warning("kvbm: a G2/G3 size below one %d-byte block turns that tier off", bb)
        self.metrics.set_capacity("G1", len(self._rows), bb)
        for tier in self.tiers:
            self.metrics.set_capacity(tier.name, tier.capacity_blocks, self.block_bytes)
        log.info(
            "kvbm %s: %d-byte blocks, tiers %s",
            self.worker_id,
            self.block_bytes,
            [t.name for t in self.tiers],
        )
        self.announce()

    def _open_host_pool(self) -> HostPool:
        cfg, fingerprint = self.config, self.layout.fingerprint
        slots = cfg.capacity_blocks(cfg.host_cache_gb, self.block_bytes)
        return HostPool(
            cfg.cache_id, fingerprint, self.block_bytes, slots, self.worker_id, self._spill, self.shm_dir
        )

    def _open_disk_pool(self) -> DiskPool:
        cfg, path = self.config, self.config.disk_path / _file_name(self.worker_id)
        slots = cfg.capacity_blocks(cfg.disk_cache_gb, self.block_bytes)
        removed = lambda hashes: self._publish("removed", G3, hashes)  # noqa: E731
        return DiskPool(
            path, self.layout.fingerprint, self.block_bytes, slots, self.metrics, cfg.disk_fsync, removed
        )

    def _open_redis_pool(self) -> RedisPool:
        cfg, link = self.config, RedisLink(self.config.redis_url, self.metrics)
        slots = cfg.capacity_blocks(cfg.redis_cache_gb, self.block_bytes)
        removed = lambda hashes: self._publish("removed", G4, hashes)  # noqa: E731
        fingerprint = self.layout.fingerprint
        return RedisPool(link, fingerprint, self.block_bytes, slots, cfg.redis_ttl_s, self.metrics, removed)

    def _publish(
        self,
        kind: str,
        tier: int,
        block_hashes: Sequence[BlockHash],
        from_tier: int = 0,
        worker_id: str | None = None,
    ) -> None:
        if self.events is None or not block_hashes:
            return
        ttl = self.config.redis_ttl_s if tier == G4 else 0
        worker = worker_id or self.worker_id
        event = TierEvent(worker, kind, tier, tuple(block_hashes), from_tier, ttl, node=self.node)  # type: ignore[arg-type]
        self.events.publish(event)

    def request_announce(self) -> None:
        """Thread-safe: re-announce everything on the engine thread's next call (service restart, Redis back)."""
        self._announce_due = True

    def _announce_if_due(self) -> None:
        if self._announce_due:
            self._announce_due = False
            self.announce()

    def announce(self) -> None:
        """Publish everything this worker holds (after bind, and when the KVBM service restarts). The G1 event goes
        out even when empty: it registers the worker, and its G2 node, with the index."""
        if self.events is not None:
            self.events.publish(
                TierEvent(self.worker_id, "stored", G1, tuple(sorted(self._g1)), node=self.node)
            )
        if self.g2 is not None:
            self._publish("stored", G2, self.g2.owned_hashes(self.worker_id))
        if self.g3 is not None:
            self._publish("stored", G3, self.g3.hashes())

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks some tier holds. Each tier, fastest first, is asked only about blocks no faster tier
        holds, and counts a hit or a miss for each block it was asked about."""
        self._announce_if_due()
        missing = list(range(len(block_hashes)))
        for tier in self.tiers:
            if not missing:
                break
            found = tier.contains([block_hashes[i] for i in missing])
            hits = sum(found)
            self.metrics.hits.labels(tier.name).inc(hits)
            self.metrics.misses.labels(tier.name).inc(len(found) - hits)
            missing = [i for i, hit in zip(missing, found, strict=True) if not hit]
        return missing[0] if missing else len(block_hashes)

    def onboard(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        """Each tier, fastest first, gets the blocks no faster tier delivered: one batched get per tier, and a
        block that is missing or fails its checksum in one tier is still taken from a slower one."""
        remaining = list(range(len(block_hashes)))
        for tier in self.tiers:
            if not remaining:
                break
            start = time.perf_counter()
            ok = tier.get([block_hashes[i] for i in remaining], [self._rows[block_ids[i]] for i in remaining])
            got = sum(ok)
            self.metrics.record_transfer(
                f"{tier.name}->G1", got, got * self.block_bytes, time.perf_counter() - start
            )
            remaining = [i for i, good in zip(remaining, ok, strict=True) if not good]
        return remaining[0] if remaining else len(block_hashes)

    def offload(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        self._announce_if_due()
        blocks = [self._rows[block_id] for block_id in block_ids]
        local = self.g2 if self.g2 is not None else self.g3
        if local is not None:
            self._offload_to(local, block_hashes, blocks)
        if self.g4 is not None and (self.config.write_through or local is None):
            present = self.g4.contains(block_hashes)
            missing = [i for i, here in enumerate(present) if not here]
            self._offload_to(self.g4, [block_hashes[i] for i in missing], [blocks[i] for i in missing])
        self._update_used()

    def _offload_to(
        self, tier: BlockTier, block_hashes: Sequence[BlockHash], blocks: list[np.ndarray]
    ) -> None:
        if not block_hashes:
            return
        start = time.perf_counter()
        if isinstance(tier, HostPool):
            result = tier.put_detailed(block_hashes, blocks)
            stored = result.stored
            if result.rejected and self.g3 is not None:  # G2 full of pinned/new blocks: go straight to disk
                rejected = result.rejected
                self._offload_to(self.g3, [block_hashes[i] for i in rejected], [blocks[i] for i in rejected])
        else:
            stored = list(block_hashes[: tier.put(block_hashes, blocks)])
        elapsed = time.perf_counter() - start
        self.metrics.record_transfer(f"G1->{tier.name}", len(stored), len(stored) * self.block_bytes, elapsed)
        self._publish("stored", int(tier.name[1]), stored)

    def _spill(self, evicted: EvictedBlock) -> None:
        """G2 is about to reuse the slot of `evicted` (called by HostPool.put, payload still intact)."""
        owner = evicted.owner or self.worker_id
        if self.g3 is None or evicted.uses < self.config.disk_min_uses:
            self._publish("removed", G2, [evicted.block_hash], worker_id=owner)
            return
        start = time.perf_counter()
        stored = self.g3.put([evicted.block_hash], [evicted.payload])
        self.metrics.record_transfer("G2->G3", stored, stored * self.block_bytes, time.perf_counter() - start)
        if owner == self.worker_id and stored:
            self._publish("moved", G3, [evicted.block_hash], from_tier=G2)
        else:
            self._publish("removed", G2, [evicted.block_hash], worker_id=owner)
            self._publish("stored", G3, [evicted.block_hash][:stored])

    def on_event(self, event: BlockEvent) -> None:
        self._announce_if_due()
        if isinstance(event, BlockStored):
            self._g1.add(event.block_hash)
            self._publish("stored", G1, [event.block_hash])
        elif isinstance(event, BlockRemoved):
            self._g1.difference_update(event.block_hashes)
            self._publish("removed", G1, event.block_hashes)
        self.metrics.set_used("G1", len(self._g1), self.block_bytes)  # G1 blocks held by the prefix cache

    def _update_used(self) -> None:
        for tier in (self.g2, self.g3):
            if tier is not None:
                self.metrics.set_used(tier.name, tier.used_blocks, self.block_bytes)
        if self.g4 is not None:
            self.metrics.set_used("G4", self.g4.last_size, self.block_bytes)

    def close(self) -> None:
        """Release files and connections; the G2 segment stays for the node's other workers."""
        for tier in self.tiers:
            tier.close()
        close_events = getattr(self.events, "close", None)
        if close_events is not None:
            close_events()
