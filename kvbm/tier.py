"""The `BlockTier` Protocol every storage tier below G1 implements (G2 host, G3 disk, G4 Redis).

A block is `block_bytes` bytes, passed as a 1-D uint8 numpy array: on `put` a view of a G1 row (read only),
on `get` a view of the destination G1 row (written in place). Tiers never keep a reference to these views.

The connector holds its tiers in one list, fastest first, and reads everything its policies need from this
Protocol: the tiers that are not `remote` form the offload chain (a block one of them has no room for, or
evicts, goes to the next), the `remote` ones are written through. A new tier is one module implementing it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

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

    name: str  # "G2", "G3", "G4": metrics labels and logs
    level: int  # 2, 3, 4: the tier number of index events; a faster tier has a lower level
    remote: bool  # held off this host for every node (G4): written through, never part of the offload chain
    ttl_s: int  # seconds a stored block lives (0: until evicted); its index events carry it
    segment: str  # name of the store every worker on this host maps ("" unless the tier is node-shared, G2)
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
