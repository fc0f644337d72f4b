"""O(1) LRU map from block hash to slot with pins, for tiers whose index lives in one process (G3)."""

from __future__ import annotations

from collections import OrderedDict

from kvbm.block_hash import BlockHash


class SlotLRU:
    """block hash -> slot number, least recently used first.

    Invariant: a pinned hash (pin count > 0) is never returned by `pop_lru`. touch/insert/remove/pin are O(1);
    `pop_lru` is O(1 + number of pinned blocks at the cold end), and pins are held only during one transfer.
    """

    def __init__(self) -> None:
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        self._pins: dict[BlockHash, int] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def hashes(self) -> list[BlockHash]:
        """Every hash, least recently used first."""
        return list(self._slots)

    def slot(self, block_hash: BlockHash) -> int | None:
        return self._slots.get(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        self._slots.move_to_end(block_hash)

    def insert(self, block_hash: BlockHash, slot: int) -> None:
        self._slots[block_hash] = slot
        self._slots.move_to_end(block_hash)

    def remove(self, block_hash: BlockHash) -> int | None:
        self._pins.pop(block_hash, None)
        return self._slots.pop(block_hash, None)

    def pin(self, block_hash: BlockHash) -> None:
        self._pins[block_hash] = self._pins.get(block_hash, 0) + 1

    def unpin(self, block_hash: BlockHash) -> None:
        count = self._pins.get(block_hash, 0) - 1
        if count > 0:
            self._pins[block_hash] = count
        else:
            self._pins.pop(block_hash, None)

    def pop_lru(self) -> tuple[BlockHash, int] | None:
        """Remove and return the least recently used unpinned entry (None if every entry is pinned)."""
        for block_hash in self._slots:
            if block_hash not in self._pins:
                return block_hash, self._slots.pop(block_hash)
        return None
