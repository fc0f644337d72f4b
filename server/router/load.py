"""What the router knows about each worker: reported stats plus its own count of what it routed there."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvbm.block_hash import BlockHash
from server.workers.protocol import WorkerStats


@dataclass(slots=True)
class WorkerLoad:
    """The router's view of one worker: the latest report and what the router itself sent there since."""

    stats: WorkerStats
    routed_blocks: int = 0  # blocks of requests routed here and not released
    routed_requests: int = 0
    pending_prefill: float = 0.0  # prefill work (blocks) of requests routed here that have no first token yet
    prefill_speed: float = 1.0  # relative to the mean of all workers (2.0 = twice as fast)
    decode_speed: float = 1.0
    in_flight_blocks: dict[BlockHash, int] = field(default_factory=dict)  # hash -> routed requests holding it

    def hold(self, block_hashes: Sequence[BlockHash]) -> None:
        for block_hash in block_hashes:
            self.in_flight_blocks[block_hash] = self.in_flight_blocks.get(block_hash, 0) + 1

    def drop(self, block_hashes: Sequence[BlockHash]) -> None:
        for block_hash in block_hashes:
            count = self.in_flight_blocks.pop(block_hash) - 1
            if count:
                self.in_flight_blocks[block_hash] = count

    def in_flight_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of a request that requests routed here hold (hashes are chained: a match is a prefix)."""
        held = self.in_flight_blocks
        count = 0
        if held:
            for block_hash in block_hashes:
                if block_hash not in held:
                    break
                count += 1
        return count

    @property
    def active_blocks(self) -> int:
        """The larger of the report and the router's own count: reports lag, and other routers add load."""
        return max(self.stats.active_blocks, self.routed_blocks)

    @property
    def in_flight(self) -> int:
        return max(self.stats.in_flight, self.routed_requests)

    def is_busy(self, threshold: float) -> bool:
        """The worker's last report (every heartbeat) shows `threshold` of its KV held by running requests:
        anything routed here now waits for one of them to finish. Requests the router sent that have not started
        hold no KV; they load the cost as pending prefill instead (counted here, a burst would turn conversations
        away from the worker holding their prefix)."""
        capacity = self.stats.kv_capacity_blocks
        return capacity > 0 and self.stats.active_blocks >= threshold * capacity


def relative_speeds(speeds: list[float]) -> list[float]:
    """Each speed over the mean of the measured ones; unmeasured (<= 0) workers count as average (1.0)."""
    measured = [s for s in speeds if s > 0]
    if not measured:
        return [1.0] * len(speeds)
    mean = sum(measured) / len(measured)
    return [s / mean if s > 0 else 1.0 for s in speeds]
