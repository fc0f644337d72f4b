"""Block tier events that workers publish and the KVBM service index applies, and their Redis Stream encoding.

On a worker's link to the server (embedded index) a `TierEvent` travels as msgpack, decoded by msgspec into this
dataclass; from the Redis Stream, `from_fields` hands the decoded field map to `msgspec.convert`. Either way the field
types and the ranges annotated here are checked, so a malformed event never reaches an index.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Literal, Protocol

import msgspec
import numpy as np

from kvbm.block_hash import BlockHash

EventKind = Literal["stored", "removed", "moved"]
G1, G2, G3, G4, G5 = 1, 2, 3, 4, 5
Tier = Annotated[int, msgspec.Meta(ge=G1, le=G5)]
WireHash = Annotated[BlockHash, msgspec.Meta(ge=0)]  # a u64 (msgpack has no larger integer)


@dataclass(frozen=True, slots=True)
class TierEvent:
    """`block_hashes` entered (stored), left (removed) or went from `from_tier` to `tier` (moved) on `worker_id`.

    Tiers are 1..5 for G1..G5. G4 (Redis) and G5 (object storage) are shared by everyone: their events name
    the writer but index globally.
    `ttl_s` (G4 stored only) makes the index forget the blocks when Redis expires them. `timestamp` is unix
    seconds at publish time (event lag = apply time - timestamp). `node` names the G2 segment (host:cache id)
    of a G2 event: every worker mapping that segment can onboard the block, so the index credits them all.
    """

    worker_id: str
    kind: EventKind
    tier: Tier
    block_hashes: tuple[WireHash, ...]
    from_tier: Annotated[int, msgspec.Meta(ge=0, le=G5)] = 0  # 0 unless moved
    ttl_s: Annotated[int, msgspec.Meta(ge=0)] = 0
    timestamp: float = field(default_factory=time.time)
    node: str = ""

    def __post_init__(self) -> None:
        """A move leaves a tier 1..5 (msgspec passes this message on unchanged, so it names the field itself)."""
        if self.kind == "moved" and not G1 <= self.from_tier <= G5:
            raise ValueError(
                f"a moved event leaves a tier {G1}..{G5}, got {self.from_tier} - at `$.from_tier`"
            )

    def to_fields(self) -> dict[bytes, bytes]:
        """Flat field map for XADD; hashes travel as packed little-endian u64."""
        return {
            b"w": self.worker_id.encode(),
            b"k": self.kind.encode(),
            b"t": b"%d" % self.tier,
            b"f": b"%d" % self.from_tier,
            b"ttl": b"%d" % self.ttl_s,
            b"ts": repr(self.timestamp).encode(),
            b"h": np.array(self.block_hashes, dtype="<u8").tobytes(),
            b"n": self.node.encode(),
        }

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> TierEvent:
        """The event an XADD field map holds (anyone on Redis may write one). Raises ValueError naming the field:
        a value that does not decode, or msgspec.ValidationError ("Expected `int` >= 1 - at `$.tier`")."""
        values = {}
        for key, (name, decode) in _STREAM_FIELDS.items():
            if key in fields:  # a missing field takes the default, or msgspec names it as required
                try:
                    values[name] = decode(fields[key])
                except ValueError as exc:  # UnicodeDecodeError included
                    raise ValueError(f"{exc} - at `$.{name}` (stream field {key.decode()})") from None
        return msgspec.convert(values, cls)


def _hashes(packed: bytes) -> list[int]:
    return np.frombuffer(packed, dtype="<u8").tolist()


_STREAM_FIELDS = {  # XADD field -> (TierEvent field, decoder); the inverse of TierEvent.to_fields
    b"w": ("worker_id", bytes.decode),
    b"k": ("kind", bytes.decode),
    b"t": ("tier", int),
    b"f": ("from_tier", int),
    b"ttl": ("ttl_s", int),
    b"ts": ("timestamp", float),
    b"h": ("block_hashes", _hashes),
    b"n": ("node", bytes.decode),
}


class EventSink(Protocol):
    """Where a worker's KVBM agent sends its tier events: the embedded index or a Redis Stream publisher."""

    def publish(self, event: TierEvent) -> None: ...
