"""The router's window onto the KVBM index: who holds a request's leading blocks, on which tier.

`kvbm.index.KVIndex` (embedded: workers' events applied in this process) and `kvbm.client.KVIndexClient` (the
standalone KVBM service over TCP) both have this shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvbm.block_hash import BlockHash
from kvbm.index import PrefixReport


class OverlapLookup(Protocol):
    @property
    def events_applied(self) -> int:
        """Block events the index has applied (never decreases): the staleness check sees a frozen index."""
        ...

    def query(self, block_hashes: Sequence[BlockHash]) -> PrefixReport:
        """Per worker the leading blocks held in G1, G1..G2, G1..G3 (cumulative), and the leading run in G4."""
        ...
