"""The router's window onto the KVBM index: who holds a request's leading blocks, on which tier.

`kvbm.index.KVIndex` answers `query` already; `CountedIndex` adds the event counter the staleness check reads.
A remote KVBM service client plugs in by having the same two members.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

from kvbm.block_hash import BlockHash
from kvbm.events import TierEvent
from kvbm.index import KVIndex, PrefixReport


class OverlapLookup(Protocol):
    @property
    def events_applied(self) -> int:
        """Block events the index has applied since it started (never decreases)."""
        ...

    def query(self, block_hashes: Sequence[BlockHash]) -> PrefixReport:
        """Per worker the leading blocks held in G1, G1..G2, G1..G3 (cumulative), and the leading run in G4."""
        ...


class CountedIndex:
    """An in-process `KVIndex` fed through `publish` (an `EventSink`), counting the events it applies."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self._events = 0
        self._lock = threading.Lock()

    @property
    def events_applied(self) -> int:
        return self._events

    def publish(self, event: TierEvent) -> None:
        self.index.apply(event)
        with self._lock:
            self._events += 1

    def query(self, block_hashes: Sequence[BlockHash]) -> PrefixReport:
        return self.index.query(block_hashes)
