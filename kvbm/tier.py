"""The `BlockTier` Protocol every storage tier below G1 implements (G2 host, G3 disk, G4 Redis, G5 object store),
and the two capabilities a tier may add to it: `NodeShared` (G2) and `WriteBehind` (G5).

A block is `block_bytes` bytes, passed as a 1-D uint8 numpy array: on `put` a view of a G1 row (read only),
on `get` a view of the destination G1 row (written in place). Tiers never keep a reference to these views.

The connector holds its tiers in one list, fastest first, and reads everything its policies need from these
Protocols, never from a tier's class: the tiers that are not `remote` form the offload chain (a block one of them
has no room for, or evicts, goes to the next); a `WriteBehind` tier gets every block leaving G1 (its `put` costs
the engine thread a copy) and is drained on close; the other `remote` ones are written through. A `NodeShared`
tier names the node in index events, and on close each process copies its blocks down the chain and leaves it.
A capability is asked with `isinstance(tier, NodeShared)` (runtime-checkable: it looks for the members, and on
Python 3.11 reads the properties while doing so, so it is asked of an open tier).

A new tier is a module implementing `BlockTier` (and the capabilities it has), a `KVBMConfig` field that turns it
on (its `--kvbm-*` flag in server/cli.py), and the line of `KVBMConnector._open_tiers` that opens it. Its `level`
is the tier number of its index events: a level past G5 also needs `kvbm.events` (the levels an event carries)
and its bit in `KVIndex` (kvbm/index.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from kvbm.block_hash import BlockHash


def copy_blocks(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """memcpy of each (dest, src) block on the calling thread. A split over threads gains on idle cores but loses
    when other processes share them, and torch's copy_ spins its OpenMP workers; one thread is the predictable
    choice on a shared CPU host (on CUDA this is a cudaMemcpyAsync batch)."""
    for dest, src in pairs:
        np.copyto(dest, src)


def layout_tag(fingerprint: str) -> str:
    """16 hex digits naming one KV layout in file names, shm names and Redis keys (never mixes layouts)."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(fingerprint.encode())


@dataclass(slots=True)
class PutResult:
    """Outcome of one `put`: `stored` the hashes whose bytes this put wrote (blocks already held are only
    touched, and not listed), `rejected` the indexes of blocks the tier found no room for (or failed to write)."""

    stored: list[BlockHash] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)


@dataclass(slots=True)
class EvictedBlock:
    """A block leaving a tier. `payload` is its bytes, valid only while the eviction callback runs (None when
    the tier no longer has them); `uses` counts its puts and gets; `owner` is the worker that stored it ("" if
    the tier does not record it)."""

    block_hash: BlockHash
    payload: np.ndarray | None = None
    uses: int = 0
    owner: str = ""


EvictFn = Callable[[list[EvictedBlock]], None]


class BlockTier(Protocol):
    """One storage tier. Capacity is in blocks; every call is batched over a sequence of blocks.

    Invariants: a block that `get` reports as valid is byte-identical to what `put` stored; a block pinned by a
    `get` in progress is never evicted; eviction order is least recently used first (put or get counts as use).
    """

    name: str  # "G2" .. "G5": metrics labels and logs
    level: int  # 2 .. 5: the tier number of index events; a faster tier has a lower level
    remote: bool  # held off this host for every node (G4, G5): never part of the offload chain
    ttl_s: int  # seconds a stored block lives (0: until evicted); its index events carry it
    on_evict: (
        EvictFn | None
    )  # told about blocks that leave (LRU victims, corrupt blocks); set by the connector

    @property
    def capacity_blocks(self) -> int: ...

    @property
    def used_blocks(self) -> int:
        """Blocks held, without I/O (a metrics gauge reads it after every offload); G4 reports its size as seen
        by this process's last put."""
        ...

    def contains(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Per block: is it stored here now (a later `get` may still miss if it is evicted or corrupt)."""
        ...

    def put(self, block_hashes: Sequence[BlockHash], blocks: Sequence[np.ndarray]) -> PutResult:
        """Store blocks (already-present ones are only touched), evicting LRU blocks through `on_evict` before
        their space is reused."""
        ...

    def get(self, block_hashes: Sequence[BlockHash], dests: Sequence[np.ndarray]) -> list[bool]:
        """Copy blocks into `dests` in one batched transfer; per block: were valid bytes written."""
        ...

    def evict(self, num_blocks: int) -> list[BlockHash]:
        """Drop up to `num_blocks` least recently used unpinned blocks; return their hashes."""
        ...

    def owned_hashes(self, owner: str) -> list[BlockHash]:
        """Blocks `owner` holds here, to re-announce to the index (after bind, or a service restart)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class NodeShared(BlockTier, Protocol):
    """A tier every worker process on the host maps (G2). Each process that stops copies the blocks it stored to
    the next tier and leaves; the last one to leave also copies the blocks nobody copied, then removes the store
    (the connector's close, kvbm/connector.py)."""

    segment: str  # name of the store the workers of this host share: index events name the node by it

    @property
    def closed(self) -> bool:
        """This process no longer maps the store (closed, or destroyed)."""
        ...

    def pinned(
        self, block_hashes: Sequence[BlockHash], touch: bool = False
    ) -> AbstractContextManager[list[np.ndarray | None]]:
        """Views of the blocks' bytes (None for a block not held), kept from eviction until the `with` ends;
        `touch` counts it as a use."""
        ...

    def flush_candidates(self, owner: str | None, min_uses: int = 1) -> list[BlockHash]:
        """Blocks used at least `min_uses` times, least recently used first: those `owner` stored, or with
        `owner` None those no process has copied down yet (`mark_flushed`)."""
        ...

    def mark_flushed(self, block_hashes: Sequence[BlockHash]) -> None:
        """Their owner dealt with these blocks on close: `flush_candidates(None)` skips them."""
        ...

    def leave(self) -> bool:
        """Stop counting as a user; True if no other process maps the store (this one then holds it alone until
        `close` or `destroy`)."""
        ...

    def destroy(self) -> None:
        """Remove the store for every process, and close."""
        ...


@runtime_checkable
class WriteBehind(BlockTier, Protocol):
    """A tier whose `put` only queues copies of the blocks; its own threads write them (G5). `put` reports no
    block as stored (`rejected`: the blocks dropped because the queue is full or the store is failing): the writes
    that finished, and the blocks the tier deleted, come from `take_changes`, and `on_evict` is never called."""

    def take_changes(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """Blocks stored and blocks removed since the last call: the index's events."""
        ...

    def unknown(self, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """The blocks this process neither knows to be held nor has queued, answered without a request."""
        ...

    def drain(self, deadline: float) -> int:
        """Wait (until `deadline`, time.monotonic()) for the queued writes; returns how many are left."""
        ...
