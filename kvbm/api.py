"""The engine's window onto the KV tiers below its own pool (G2 host, G3 disk, G4 Redis, G5 objects): the KVBM
agent.

KV layout (fixed, so that a block moves as one contiguous span of bytes):

    kv_cache: torch.Tensor, shape [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]
    kv_cache[block_id] is one block: `block_bytes` contiguous bytes, all layers, K then V.

All calls come from the engine thread, between forward passes, so a connector may read or write `kv_cache` rows
directly. A connector that fails must not take the engine down: lookups that error count as misses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvbm.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one engine's KV pool; `fingerprint` keys every stored block so models never mix."""

    fingerprint: str
    num_layers: int
    block_size: int  # tokens
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block entered the engine's prefix cache (G1), in row `block_id` of the pool (-1: not said)."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_id: int = -1


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left G1 (evicted or reset); they may still live in a lower tier."""

    block_hashes: tuple[BlockHash, ...]


BlockEvent = BlockStored | BlockRemoved


@dataclass(frozen=True, slots=True)
class TierRead:
    """One tier's part of an onboard: `blocks` valid blocks (`bytes`) read from `tier` ("G2".."G5") over
    [start_ns, end_ns] (time.time_ns), for a traced request's span."""

    tier: str
    blocks: int
    bytes: int
    start_ns: int
    end_ns: int


class KVConnector(Protocol):
    def bind(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        """Called once when the engine has allocated its pool."""
        ...

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `block_hashes` (none of them in G1) the lower tiers can onboard."""
        ...

    def onboard(
        self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], reads: list[TierRead] | None = None
    ) -> int:
        """Copy blocks into these G1 rows in one batched transfer; return how many leading blocks are valid
        (a checksum mismatch stops there: the engine prefills the rest). With `reads`, append one `TierRead` per
        tier read (a traced request)."""
        ...

    def offload(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """These cached G1 blocks are about to be overwritten (eviction) or were just stored (write-through):
        copy them out before the engine reuses the rows."""
        ...

    def on_event(self, event: BlockEvent) -> None:
        """Block events for the KVBM service index (and the router)."""
        ...

    def close(self) -> None:
        """The engine has stopped (it calls this from its close): release the tiers. Idempotent."""
        ...
