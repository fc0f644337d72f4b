"""`KVBMConnector`: the engine's KVConnector over G2 host shm, G3 disk, G4 Redis and G5 object storage (the
per-worker KVBM agent).

Policies:
  offload   G1 eviction -> the first local tier (G2, or G3 when there is no G2), else the remote one (G4);
            blocks a local tier has no room for (G2: every way of their set pinned or claimed by the same
            batch) go straight to the next local tier; with `write_through` every offloaded block is also
            written to the remote tier (G4). Every block leaving G1 is also queued for the bucket (G5), and
            with `write_through` every block as soon as it is computed (its BlockStored event); the uploads
            run on the tier's threads and their stored events are published on the engine thread's next call.
  spill     a block a local tier evicts goes to the next local tier (G2 -> G3) if it was used at least
            `disk_min_uses` times, else it is dropped.
  onboard   one batched transfer per tier, fastest first (G2 memcpy, G3 preadv of consecutive slots, G4 one
            MGET pipeline, G5 concurrent GETs), each tier asked only for the blocks no faster tier delivered, so a block missing or
            corrupt in G3 still comes from G4; the engine gets the leading run of valid blocks.
  lookup    the leading run of blocks some tier holds (G2 headers, G3 in-memory index, G4 one EXISTS pipeline,
            G5 one HEAD for a miss). G5 is last: Redis answers from memory, a bucket from farther away.
  close     G2 is node memory, and a graceful stop must neither lose its blocks nor leak it: each process
            copies the G2 blocks it stored (used at least `disk_min_uses` times) that its G3 lacks into it,
            hottest first, within `flush_budget_s`, then leaves the segment. The last process to leave
            (host_pool.py counts users with kernel-held locks, so killed ones do not count) also copies the
            blocks whose owners left without doing so, and removes the segment unless `keep_host_cache`. In
            `strata serve` that is the server for an in-process engine, the last of its workers to stop with
            --workers N, or a `strata worker` of the same node that outlives them. With G5, the G2 blocks
            this process stored that the bucket lacks are uploaded too, and the upload queue drained, within
            the same budget.
Tiers: reached only through the Protocols of kvbm/tier.py: `BlockTier`, and the capabilities `NodeShared` (G2:
the close above) and `WriteBehind` (G5: every block leaving G1, drained on close); `_open_tiers` is the one place
that names their classes.
Events: every change of what this worker holds (G1 from the engine's events, G2..G5 from the tiers) is
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
from functools import partial
from pathlib import Path

import numpy as np
import torch

from cluster.redis_link import RedisLink
from kvbm.api import BlockEvent, BlockRemoved, BlockStored, KVLayout, TierRead
from kvbm.block_hash import BlockHash
from kvbm.config import KVBMConfig
from kvbm.disk_pool import DiskPool
from kvbm.events import G1, EventKind, EventSink, TierEvent
from kvbm.host_pool import SHM_DIR, HostPool
from kvbm.metrics import KVBMMetrics
from kvbm.object_pool import ObjectPool
from kvbm.redis_pool import RedisPool
from kvbm.tier import BlockTier, EvictedBlock, NodeShared, WriteBehind

log = logging.getLogger(__name__)

FLUSH_BATCH = 64  # blocks per G2 -> G3 copy on close: one pin of G2 slots, one G3 put, one budget check


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
        model: str = "",
    ) -> None:
        """`model`: the served model, the `model` label of this connector's tier and transfer series."""
        config.validate()
        self.config = config
        self.worker_id = worker_id
        self.metrics = (metrics if metrics is not None else KVBMMetrics()).for_model(model)
        self.events = events
        self.shm_dir = shm_dir
        self.tiers: list[BlockTier] = []  # below G1, fastest first (opened by `bind`)
        self._chain: list[
            BlockTier
        ] = []  # the local tiers: offload goes to the first, each spills to the next
        self._remote: list[BlockTier] = []  # written through (G4)
        self._behind: list[WriteBehind] = []  # written behind (G5): every block leaving G1
        self._host: NodeShared | None = None  # G2 while this connector maps it (left on close)
        self._closed = False
        self._g1: set[BlockHash] = set()
        self._announce_due = False  # set from other threads, served on the engine thread
        self.node = ""  # the G2 segment this worker shares with the others on its host (index events name it)

    def bind(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self._rows = block_rows(kv_cache, kv_cache.shape[0])
        self.tiers = self._open_tiers()
        self._chain = [tier for tier in self.tiers if not tier.remote]
        self._behind = [tier for tier in self.tiers if isinstance(tier, WriteBehind)]
        self._remote = [tier for tier in self.tiers if tier.remote and tier not in self._behind]
        self._host = next((tier for tier in self.tiers if isinstance(tier, NodeShared)), None)
        self.node = f"{socket.gethostname()}:{self._host.segment}" if self._host is not None else ""
        self.metrics.set_capacity("G1", len(self._rows), self.block_bytes)
        for tier in self.tiers:
            tier.on_evict = partial(self._evicted, tier)
            self.metrics.set_capacity(tier.name, tier.capacity_blocks, self.block_bytes)
        log.info(
            "kvbm %s: %d-byte blocks, tiers %s",
            self.worker_id,
            self.block_bytes,
            [t.name for t in self.tiers],
        )
        self.announce()

    def _open_tiers(self) -> list[BlockTier]:
        """The configured tiers, fastest first; a G2 or G3 smaller than one block is off. A tier that fails to
        open closes the ones opened before it (a G2 segment this process created is removed), then raises."""
        cfg, bb, fingerprint = self.config, self.block_bytes, self.layout.fingerprint
        host_slots = cfg.capacity_blocks(cfg.host_cache_gb, bb)
        disk_slots = cfg.capacity_blocks(cfg.disk_cache_gb, bb)
        if (cfg.host_cache_gb > 0 and host_slots == 0) or (cfg.disk_cache_gb > 0 and disk_slots == 0):
            log.warning("kvbm: a G2/G3 size below one %d-byte block turns that tier off", bb)
        tiers: list[BlockTier] = []
        try:
            if host_slots > 0:
                owner = self.worker_id
                tiers.append(HostPool(cfg.cache_id, fingerprint, bb, host_slots, owner, shm_dir=self.shm_dir))
            if disk_slots > 0:
                path = cfg.disk_path / _file_name(self.worker_id)
                tiers.append(DiskPool(path, fingerprint, bb, disk_slots, self.metrics, cfg.disk_fsync))
            if cfg.redis_url:
                link = RedisLink(cfg.redis_url, self.metrics.redis_up)
                slots = cfg.capacity_blocks(cfg.redis_cache_gb, bb)
                tiers.append(
                    RedisPool(link, cfg.block_key, fingerprint, bb, slots, cfg.redis_ttl_s, self.metrics)
                )
            if cfg.object_url:
                slots, timeout_s = cfg.capacity_blocks(cfg.object_cache_gb, bb), cfg.object_timeout_s
                tiers.append(
                    ObjectPool(cfg.object_url, cfg.block_key, fingerprint, bb, slots, timeout_s, self.metrics)
                )
        except BaseException:
            for tier in tiers:
                if isinstance(tier, NodeShared) and tier.leave() and not cfg.keep_host_cache:
                    tier.destroy()  # this process created the segment and nobody else maps it
                else:
                    tier.close()
            raise
        return tiers

    def _below(self, tier: BlockTier) -> BlockTier | None:
        """The next tier of the offload chain after `tier` (None after the last one, and for a remote tier)."""
        if tier.remote:
            return None
        position = self._chain.index(tier) + 1
        return self._chain[position] if position < len(self._chain) else None

    def _publish(
        self,
        kind: EventKind,
        tier: BlockTier,
        block_hashes: Sequence[BlockHash],
        from_tier: BlockTier | None = None,
        worker_id: str | None = None,
    ) -> None:
        """Tell the index that `worker_id` (default: this worker) stored, removed or moved blocks in `tier`."""
        if self.events is None or not block_hashes:
            return
        event = TierEvent(
            worker_id=worker_id or self.worker_id,
            kind=kind,
            tier=tier.level,
            block_hashes=tuple(block_hashes),
            from_tier=from_tier.level if from_tier is not None else 0,
            ttl_s=tier.ttl_s,
            node=self.node,
        )
        self.events.publish(event)

    def _publish_g1(self, kind: EventKind, block_hashes: Sequence[BlockHash]) -> None:
        if self.events is not None:
            event = TierEvent(
                worker_id=self.worker_id, kind=kind, tier=G1, block_hashes=tuple(block_hashes), node=self.node
            )
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
        if self.events is None:
            return
        self._publish_g1("stored", sorted(self._g1))
        for tier in self.tiers:
            self._publish("stored", tier, tier.owned_hashes(self.worker_id))

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks some tier holds. Each tier, fastest first, is asked only about blocks no faster tier
        holds, and counts a hit or a miss for each block it was asked about."""
        self._announce_if_due()
        self._publish_changes()
        missing = list(range(len(block_hashes)))
        for tier in self.tiers:
            if not missing:
                break
            found = tier.contains([block_hashes[i] for i in missing])
            hits = sum(found)
            self.metrics.record_lookup(tier.name, hits, len(found) - hits)
            missing = [i for i, hit in zip(missing, found, strict=True) if not hit]
        return missing[0] if missing else len(block_hashes)

    def onboard(
        self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], reads: list[TierRead] | None = None
    ) -> int:
        """Each tier, fastest first, gets the blocks no faster tier delivered: one batched get per tier, and a
        block that is missing or fails its checksum in one tier is still taken from a slower one."""
        remaining = list(range(len(block_hashes)))
        for tier in self.tiers:
            if not remaining:
                break
            start, start_ns = time.perf_counter(), time.time_ns() if reads is not None else 0
            ok = tier.get([block_hashes[i] for i in remaining], [self._rows[block_ids[i]] for i in remaining])
            self._record_transfer(f"{tier.name}->G1", sum(ok), start)
            if reads is not None and any(ok):  # a traced request's span of this read
                blocks = sum(ok)
                reads.append(TierRead(tier.name, blocks, blocks * self.block_bytes, start_ns, time.time_ns()))
            remaining = [i for i, good in zip(remaining, ok, strict=True) if not good]
        return remaining[0] if remaining else len(block_hashes)

    def offload(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        self._announce_if_due()
        blocks = [self._rows[block_id] for block_id in block_ids]
        if self._chain:
            self._offload_to(self._chain[0], block_hashes, blocks)
        if self.config.write_through or not self._chain:
            for tier in self._remote:
                present = tier.contains(block_hashes)
                missing = [i for i, here in enumerate(present) if not here]
                self._offload_to(tier, [block_hashes[i] for i in missing], [blocks[i] for i in missing])
        self._write_behind(block_hashes, blocks)
        self._update_used()

    def _write_behind(self, block_hashes: Sequence[BlockHash], blocks: Sequence[np.ndarray]) -> None:
        """Queue blocks for the write-behind tiers (G5: a copy each, made here; the writes are the tier's), and
        publish what they stored."""
        for tier in self._behind:
            tier.put(block_hashes, blocks)
        self._publish_changes()

    def _publish_changes(self) -> None:
        """Index events of the writes and deletions the write-behind tiers (G5) finished since the last call
        (engine thread)."""
        for tier in self._behind:
            stored, removed = tier.take_changes()
            self._publish("stored", tier, stored)
            self._publish("removed", tier, removed)

    def _offload_to(
        self, tier: BlockTier, block_hashes: Sequence[BlockHash], blocks: list[np.ndarray]
    ) -> None:
        """Put G1 blocks into `tier`; the ones it has no room for go on to the next tier of the chain."""
        if not block_hashes:
            return
        start = time.perf_counter()
        result = tier.put(block_hashes, blocks)
        self._record_transfer(f"G1->{tier.name}", len(result.stored), start)
        self._publish("stored", tier, result.stored)
        below = self._below(tier)
        if result.rejected and below is not None:
            rejected = result.rejected
            self._offload_to(below, [block_hashes[i] for i in rejected], [blocks[i] for i in rejected])

    def _evicted(self, tier: BlockTier, evicted: list[EvictedBlock]) -> None:
        """`tier` is dropping these blocks (called from its put, payloads still intact): a block used at least
        `disk_min_uses` times spills to the next tier of the chain, the others leave their owner's holdings."""
        below = self._below(tier)
        dropped: list[EvictedBlock] = []
        for block in evicted:
            if below is None or block.payload is None or block.uses < self.config.disk_min_uses:
                dropped.append(block)
            else:
                self._spill(tier, below, block, block.payload)
        for owner in dict.fromkeys(block.owner for block in dropped):
            hashes = [block.block_hash for block in dropped if block.owner == owner]
            self._publish("removed", tier, hashes, worker_id=owner or self.worker_id)

    def _spill(self, tier: BlockTier, below: BlockTier, evicted: EvictedBlock, payload: np.ndarray) -> None:
        """Copy one block `tier` evicts into `below`: the owner's index entry moves with it."""
        owner = evicted.owner or self.worker_id
        start = time.perf_counter()
        result = below.put([evicted.block_hash], [payload])
        self._record_transfer(f"{tier.name}->{below.name}", len(result.stored), start)
        if owner == self.worker_id and not result.rejected:
            self._publish("moved", below, [evicted.block_hash], from_tier=tier)
        else:
            self._publish("removed", tier, [evicted.block_hash], worker_id=owner)
            self._publish("stored", below, result.stored)

    def _record_transfer(self, direction: str, blocks: int, start: float) -> None:
        """Metrics of one batched transfer of `blocks` blocks that began at `start` (perf_counter seconds)."""
        elapsed = time.perf_counter() - start
        self.metrics.record_transfer(direction, blocks, blocks * self.block_bytes, elapsed)

    def on_event(self, event: BlockEvent) -> None:
        self._announce_if_due()
        if isinstance(event, BlockStored):
            self._g1.add(event.block_hash)
            self._publish_g1("stored", [event.block_hash])
            if self._behind and self.config.write_through and event.block_id >= 0:
                self._write_behind([event.block_hash], [self._rows[event.block_id]])
        elif isinstance(event, BlockRemoved):
            self._g1.difference_update(event.block_hashes)
            if event.block_hashes:
                self._publish_g1("removed", event.block_hashes)
        self.metrics.set_used("G1", len(self._g1), self.block_bytes)  # G1 blocks held by the prefix cache

    def _update_used(self) -> None:
        for tier in self.tiers:
            self.metrics.set_used(tier.name, tier.used_blocks, self.block_bytes)

    def close(self) -> None:
        """Leave the node's G2 segment (`_leave_host`), then release files and connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self.config.flush_budget_s
        if self._host is not None and not self._host.closed:  # a test or bench may have destroyed it already
            self._leave_host(self._host)
        self._host = None
        for tier in self._behind:
            left = tier.drain(deadline)
            if left:
                log.warning(
                    "kvbm %s: --kvbm-flush-secs spent: %d uploads to %s dropped",
                    self.worker_id, left, tier.name,
                )  # fmt: skip
        self._publish_changes()
        for tier in self.tiers:
            tier.close()
        close_events = getattr(self.events, "close", None)
        if close_events is not None:
            close_events()

    def _leave_host(self, host: NodeShared) -> None:
        """Copy this worker's G2 blocks to the next local tier; if this is the segment's last process, also
        the blocks nobody copied, then remove the segment unless `keep_host_cache` (module docstring)."""
        below = self._below(host) if self.config.flush_budget_s > 0 else None
        deadline = time.monotonic() + self.config.flush_budget_s
        min_uses = self.config.disk_min_uses
        own = host.flush_candidates(self.worker_id, min_uses)
        if below is not None:
            self._flush(host, below, own, deadline)
        self._flush_behind(host, own)
        last = host.leave()
        if last:
            orphans = host.flush_candidates(None, min_uses)
            if below is not None:
                self._flush(host, below, orphans, deadline)
            self._flush_behind(host, orphans)
        if last and not self.config.keep_host_cache:
            host.destroy()
            log.info(
                "kvbm %s: removed G2 segment %s (last process to close it)", self.worker_id, host.segment
            )
        else:
            host.close()

    def _flush(
        self, host: NodeShared, below: BlockTier, block_hashes: list[BlockHash], deadline: float
    ) -> None:
        """Copy the G2 blocks `below` lacks into it in batches, hottest first, until `deadline`
        (time.monotonic()): a spent budget or a `below` too small loses the coldest. `block_hashes` is in LRU
        order. Marks the blocks it copied or left out on purpose (see NodeShared.mark_flushed)."""
        present = below.contains(block_hashes)
        missing = [h for h, here in zip(block_hashes, present, strict=True) if not here]
        skipped = len(missing) - min(len(missing), below.capacity_blocks)  # would evict what this copies
        host.mark_flushed(
            [h for h, here in zip(block_hashes, present, strict=True) if here] + missing[:skipped]
        )
        hottest_first = missing[skipped:][::-1]
        start, copied = time.perf_counter(), 0
        for offset in range(0, len(hottest_first), FLUSH_BATCH):
            if time.monotonic() > deadline:
                log.warning(
                    "kvbm %s: --kvbm-flush-secs %.1f spent: %d colder G2 blocks not copied to %s",
                    self.worker_id, self.config.flush_budget_s, len(hottest_first) - offset, below.name,
                )  # fmt: skip
                break
            try:
                copied += self._flush_batch(host, below, hottest_first[offset : offset + FLUSH_BATCH])
            except OSError as err:  # a failing disk must not keep the segment from being left (or removed)
                log.warning("kvbm %s: copying G2 blocks to %s failed: %s", self.worker_id, below.name, err)
                break
        if copied:
            elapsed = time.perf_counter() - start
            log.info(
                "kvbm %s: copied %d G2 blocks (%.0f MiB) to %s in %.2f s",
                self.worker_id, copied, copied * self.block_bytes / 2**20, below.name, elapsed,
            )  # fmt: skip

    def _flush_behind(self, host: NodeShared, block_hashes: list[BlockHash]) -> None:
        """Queue for each write-behind tier (G5) the G2 blocks it does not hold (their eviction from G1 queued
        them once already; these are the writes that were dropped or failed), hottest first; `close` drains the
        queues."""
        if self.config.flush_budget_s <= 0:
            return
        for tier in self._behind:
            missing = tier.unknown(block_hashes)[::-1]
            for offset in range(0, len(missing), FLUSH_BATCH):
                batch = missing[offset : offset + FLUSH_BATCH]
                with host.pinned(batch) as payloads:
                    rows = [i for i, payload in enumerate(payloads) if payload is not None]
                    tier.put([batch[i] for i in rows], [payloads[i] for i in rows])

    def _flush_batch(self, host: NodeShared, below: BlockTier, block_hashes: list[BlockHash]) -> int:
        """One batch of `_flush`, written to `below` straight from the pinned G2 slots; returns the blocks
        `below` stored."""
        with host.pinned(block_hashes) as payloads:
            rows = [i for i, payload in enumerate(payloads) if payload is not None]  # evicted since: skipped
            start = time.perf_counter()
            result = below.put([block_hashes[i] for i in rows], [payloads[i] for i in rows])
        self._record_transfer(f"{host.name}->{below.name}", len(result.stored), start)
        self._publish("stored", below, result.stored)
        rejected = {rows[i] for i in result.rejected}
        host.mark_flushed([block_hashes[i] for i in rows if i not in rejected])
        return len(result.stored)
