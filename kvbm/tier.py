"""The `BlockTier` Protocol every storage tier below G1 implements (G2 host, G3 disk, G4 Redis).

A block is `block_bytes` bytes, passed as a 1-D uint8 numpy array: on `put` a view of a G1 row (read only),
on `get` a view of the destination G1 row (written in place). Tiers never keep a reference to these views.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvbm.block_hash import BlockHash

TIER_NAMES = ("G1", "G2", "G3", "G4")


def copy_blocks(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """memcpy of each (dest, src) block on the calling thread. Measured here: a 2-thread split doubles throughput
    on idle cores but halves it when other processes share them, and torch's copy_ spins its OpenMP workers;
    one thread is the predictable choice on a shared CPU host (on CUDA this is a cudaMemcpyAsync batch)."""
    for dest, src in pairs:
        np.copyto(dest, src)


def layout_tag(fingerprint: str) -> str:
    """16 hex digits naming one KV layout in file names, shm names and Redis keys (never mixes layouts)."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(fingerprint.encode())


class BlockTier(Protocol):
    """One storage tier. Capacity is in blocks; every call is batched over a sequence of blocks.

    Invariants: a block that `get` reports as valid is byte-identical to what `put` stored; a block pinned by a
    `get` in progress is never evicted; eviction order is least recently used first (put or get counts as use).
    """

    name: str  # "G2", "G3" or "G4"

    @property
    def capacity_blocks(self) -> int: ...

    @property
    def used_blocks(self) -> int: ...

    def contains(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Per block: is it stored here now (a later `get` may still miss if it is evicted or corrupt)."""
        ...

    def put(self, block_hashes: Sequence[BlockHash], blocks: Sequence[np.ndarray]) -> int:
        """Store blocks (already-present ones are only touched), evicting LRU blocks; return how many leading
        blocks are now held here (a block that found no room ends the run)."""
        ...

    def get(self, block_hashes: Sequence[BlockHash], dests: Sequence[np.ndarray]) -> list[bool]:
        """Copy blocks into `dests` in one batched transfer; per block: were valid bytes written."""
        ...

    def evict(self, num_blocks: int) -> list[BlockHash]:
        """Drop up to `num_blocks` least recently used unpinned blocks; return their hashes."""
        ...

    def close(self) -> None: ...
