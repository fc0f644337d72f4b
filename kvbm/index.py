"""The KVBM service index: block hash -> which worker holds it on which tier, plus whether G4 and G5 hold it.

Each block hash maps to one Python int used as a bit set (`W` = max_workers bit planes):

    bit (tier - 1) * W + slot   worker in `slot` holds the block in G1 / G2 / G3   (tier 1..3)
    bit 3 * W                   the block is in G4 (Redis, shared by everyone)
    bit 3 * W + 1               the block is in G5 (the object store, shared by everyone)
    bit 3 * W + 2 + node        the block is in the G2 segment `node`, shared by every worker on it
                                (G2 events that name a node; workers join a node by naming it)

A query walks the hashes once, AND-ing per-tier "still unbroken" worker sets, so its cost is a few big-int
operations per block, independent of the number of indexed blocks. Removing a dead worker is O(1): its slot
leaves `live` (queries ignore its bits at once) and is retired; `sweep` clears retired bits later (it runs
when a slot is needed, or when the service is idle), after which the slot can be reused.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvbm.block_hash import BlockHash
from kvbm.events import G2, G4, G5, TierEvent
from kvbm.metrics import KVBMMetrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerPrefix:
    """Leading blocks of the query a worker holds in that tier *or a faster one* (so g1 <= g2 <= g3), blocks."""

    g1: int = 0
    g2: int = 0
    g3: int = 0


@dataclass(slots=True)
class PrefixReport:
    """Answer to one query: per worker the cumulative leading prefix per tier, and the leading prefixes in the
    shared tiers: G4, and G4 or G5 (so g4 <= g5)."""

    num_blocks: int
    workers: dict[str, WorkerPrefix] = field(default_factory=dict)
    g4: int = 0
    g5: int = 0


class KVIndex:
    """In-process index (embedded mode, and the core of the standalone service); one lock guards every call."""

    def __init__(self, max_workers: int = 64, metrics: KVBMMetrics | None = None) -> None:
        self.max_workers = max_workers
        self.metrics = metrics
        self._masks: dict[int, int] = {}
        self._g4_expiry: dict[int, float] = {}
        self._slot_of: dict[str, int] = {}
        self._worker_of: dict[int, str] = {}
        self._free = list(range(max_workers - 1, -1, -1))
        self._retired = 0  # bit set of slots whose bits still need a sweep
        self._live = 0
        self._plane = (1 << max_workers) - 1
        self._g4_bit = 1 << (3 * max_workers)
        self._g5_bit = 1 << (3 * max_workers + 1)
        self._node_base = 3 * max_workers + 2
        self._node_slot: dict[str, int] = {}
        self._node_members: list[int] = []  # per node slot: bit set of the worker slots on it
        self._node_of_worker: dict[int, int] = {}
        self._lock = threading.RLock()
        self._events_applied = 0

    def __len__(self) -> int:
        return len(self._masks)

    @property
    def events_applied(self) -> int:
        """Events applied so far (never decreases): a router's staleness check sees a frozen index with it."""
        return self._events_applied

    @property
    def workers(self) -> list[str]:
        return list(self._slot_of)

    def _register(self, worker_id: str) -> int:
        """Slot of a worker, allocating one (sweeping retired slots if none is free); caller holds the lock."""
        slot = self._slot_of.get(worker_id)
        if slot is not None:
            return slot
        if not self._free and self._retired:
            self._sweep()
        if not self._free:
            raise RuntimeError(f"KVIndex is full: {self.max_workers} live workers (raise max_workers)")
        slot = self._free.pop()
        self._slot_of[worker_id], self._worker_of[slot] = slot, worker_id
        self._live |= 1 << slot
        self._update_gauges()
        return slot

    def remove_worker(self, worker_id: str) -> None:
        """Forget everything a worker holds in G1..G3 (lease expired); O(1), bits are swept later."""
        with self._lock:
            self._remove(worker_id)

    def _remove(self, worker_id: str) -> None:
        slot = self._slot_of.pop(worker_id, None)
        if slot is None:
            return
        del self._worker_of[slot]
        ns = self._node_of_worker.pop(slot, None)
        if ns is not None:
            self._node_members[ns] &= ~(1 << slot)
        self._live &= ~(1 << slot)
        self._retired |= 1 << slot
        log.info("kvbm index: worker %s removed", worker_id)
        self._update_gauges()

    def sweep(self) -> None:
        """Clear retired slots' bits from every entry and free those slots (O(indexed blocks))."""
        with self._lock:
            self._sweep()

    def _sweep(self) -> None:
        retired = self._retired
        if not retired:
            return
        keep = ~(retired | retired << self.max_workers | retired << 2 * self.max_workers)
        dead = []
        for block_hash, mask in self._masks.items():
            if mask & ~keep:
                mask &= keep
                self._masks[block_hash] = mask
                if not mask:
                    dead.append(block_hash)
        for block_hash in dead:
            del self._masks[block_hash]
        self._free += [slot for slot in range(self.max_workers) if retired >> slot & 1]
        self._retired = 0
        self._update_gauges()

    def publish(self, event: TierEvent) -> None:
        """EventSink: embedded mode applies events directly."""
        self.apply(event)

    def apply(self, event: TierEvent) -> None:
        with self._lock:
            self._events_applied += 1
            self._apply(event)

    def _apply(self, event: TierEvent) -> None:
        known = event.worker_id in self._slot_of
        shared = event.tier in (G4, G5) or (event.tier == G2 and bool(event.node))
        if event.kind == "removed" and not known and not shared:
            return  # a worker we already forgot
        slot = self._register(event.worker_id) if known or event.kind != "removed" else -1
        if event.node and slot >= 0:
            self._join(slot, event.node)
        if event.kind in ("removed", "moved"):
            tier = event.from_tier if event.kind == "moved" else event.tier
            self._clear(event.block_hashes, self._bit(tier, slot, event.node))
        if event.kind in ("stored", "moved"):
            self._set(event.block_hashes, self._bit(event.tier, slot, event.node))
            if event.tier == G4 and event.ttl_s:
                expiry = event.timestamp + event.ttl_s
                self._g4_expiry.update((h, expiry) for h in event.block_hashes)
        if self.metrics is not None:
            self.metrics.event_lag.observe(max(0.0, time.time() - event.timestamp))
            self.metrics.index_blocks.set(len(self._masks))

    def _bit(self, tier: int, slot: int, node: str) -> int:
        if tier == G4:
            return self._g4_bit
        if tier == G5:
            return self._g5_bit
        if tier == G2 and node:
            return 1 << (self._node_base + self._node(node))
        return 1 << ((tier - 1) * self.max_workers + slot)

    def _node(self, node: str) -> int:
        ns = self._node_slot.get(node)
        if ns is None:
            ns = self._node_slot[node] = len(self._node_members)
            self._node_members.append(0)
        return ns

    def _join(self, slot: int, node: str) -> None:
        """Make `slot` a member of `node` (a worker names its node in its events; it can move only by restart)."""
        ns, old = self._node(node), self._node_of_worker.get(slot)
        if old == ns:
            return
        if old is not None:
            self._node_members[old] &= ~(1 << slot)
        self._node_members[ns] |= 1 << slot
        self._node_of_worker[slot] = ns

    def _node_workers(self, node_bits: int) -> int:
        """Worker slots on any of the nodes in `node_bits`."""
        workers = 0
        while node_bits:
            low = node_bits & -node_bits
            node_bits ^= low
            workers |= self._node_members[low.bit_length() - 1]
        return workers

    def _set(self, block_hashes: Sequence[BlockHash], bit: int) -> None:
        masks = self._masks
        for block_hash in block_hashes:
            masks[block_hash] = masks.get(block_hash, 0) | bit

    def _clear(self, block_hashes: Sequence[BlockHash], bit: int) -> None:
        masks = self._masks
        for block_hash in block_hashes:
            mask = masks.get(block_hash, 0) & ~bit
            if mask:
                masks[block_hash] = mask
            else:
                masks.pop(block_hash, None)
                self._g4_expiry.pop(block_hash, None)

    def query(self, block_hashes: Sequence[BlockHash]) -> PrefixReport:
        """Per live worker the cumulative leading prefix per tier, and the shared tiers' leading prefixes."""
        with self._lock:
            return self._query(block_hashes)

    def _query(self, block_hashes: Sequence[BlockHash]) -> PrefixReport:
        width, plane, masks = self.max_workers, self._plane, self._masks
        alive1 = alive2 = alive3 = self._live
        ends: list[tuple[int, int, int]] = []  # (tier index, slot bits, prefix length)
        g4_alive, g4_len, previous, now = True, 0, -1, time.time()
        g5_alive, g5_len = True, 0
        position = 0
        for position, block_hash in enumerate(block_hashes):
            mask = masks.get(block_hash, 0)
            if mask != previous:
                previous = mask
                held1 = mask & plane
                held2 = held1 | (mask >> width) & plane
                if mask >> self._node_base:
                    held2 |= self._node_workers(mask >> self._node_base)
                held3 = held2 | (mask >> 2 * width) & plane
                if alive1 & ~held1:
                    ends.append((0, alive1 & ~held1, position))
                    alive1 &= held1
                if alive2 & ~held2:
                    ends.append((1, alive2 & ~held2, position))
                    alive2 &= held2
                if alive3 & ~held3:
                    ends.append((2, alive3 & ~held3, position))
                    alive3 &= held3
            if g5_alive:
                in_g4 = bool(mask & self._g4_bit) and self._g4_expiry.get(block_hash, math.inf) > now
                g4_alive = g4_alive and in_g4
                g4_len += g4_alive
                g5_alive = in_g4 or bool(mask & self._g5_bit)
                g5_len += g5_alive
            if not alive3 and not g5_alive:
                break
        else:
            position = len(block_hashes)
        ends += [(0, alive1, position), (1, alive2, position), (2, alive3, position)]
        return PrefixReport(len(block_hashes), self._worker_prefixes(ends), g4_len, g5_len)

    def _worker_prefixes(self, ends: list[tuple[int, int, int]]) -> dict[str, WorkerPrefix]:
        lengths: dict[int, list[int]] = {}
        for tier_index, bits, length in ends:
            while bits:
                low = bits & -bits
                bits ^= low
                if length:
                    lengths.setdefault(low.bit_length() - 1, [0, 0, 0])[tier_index] = length
        return {self._worker_of[slot]: WorkerPrefix(*lens) for slot, lens in lengths.items()}

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.index_workers.set(len(self._slot_of))
            self.metrics.index_blocks.set(len(self._masks))
