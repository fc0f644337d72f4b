"""The router's window onto the KVBM index: who holds a request's leading blocks, on which tier.

`kvbm.index.KVIndex` and the KVBM service's `kvbm.client.KVIndexClient` answer `query` already; `CountedIndex`
adds the event counter (`EventCounted`) that lets the staleness check see a frozen index, not only an empty one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvbm.block_hash import BlockHash
from kvbm.events import TierEvent
from kvbm.index import KVIndex, PrefixReport


class OverlapLookup(Protocol):
    def query(self, block_hashes: Sequence[BlockHash]) -> PrefixReport:
        """Per worker the leading blocks held in G1, G1..G2, G1..G3 (cumulative), and the leading run in G4."""
        ...


@runtime_checkable
class EventCounted(Protocol):
    """A lookup that also says how many block events its index has applied (never decreases); the router's
    staleness check reads it. Without it the check can only notice an index that answers nothing at all."""

    @property
    def events_applied(self) -> int: ...


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
