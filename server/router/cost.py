"""The KV-aware cost of serving one request on one worker, in blocks of work at average worker speed.

    cost = overlap_weight * (pending_prefill + blocks_to_prefill) / prefill_speed
           + (active_blocks + request_blocks) / decode_speed

where a block already in the worker's G1 costs nothing, one it can onboard from G2/G3/G4/G5 costs that tier's
fraction of a prefill, and the rest cost one prefill each; `pending_prefill` is the prefill work of requests
already routed to the worker that have not produced their first token (the queue a new request waits behind). Speeds are relative to the mean worker, so a worker
twice as fast sees half the cost for the same work and ends up with about twice the requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbm.index import PrefixReport, WorkerPrefix
from server.router.config import RouterConfig
from server.router.load import WorkerLoad

_NO_PREFIX = WorkerPrefix()


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Leading blocks every worker can onboard from the shared tiers: from G4, and from G4 or G5 (g4 <= g5)."""

    g4: int = 0
    g5: int = 0

    @classmethod
    def of(cls, report: PrefixReport | None) -> SharedPrefix:
        return cls(report.g4, max(report.g4, report.g5)) if report is not None else NO_SHARED


NO_SHARED = SharedPrefix()


def reusable_blocks(prefix: WorkerPrefix | None, shared: SharedPrefix) -> int:
    """Leading blocks the worker can take from any tier instead of prefilling them."""
    prefix = prefix or _NO_PREFIX
    return max(prefix.g1, prefix.g2, prefix.g3, shared.g4, shared.g5)


def blocks_to_prefill(
    num_blocks: int, prefix: WorkerPrefix | None, shared: SharedPrefix, config: RouterConfig
) -> float:
    """Prefill work left on a worker, in blocks (onboarded blocks count at their tier's fraction)."""
    prefix = prefix or _NO_PREFIX
    g1 = min(prefix.g1, num_blocks)
    g2 = min(max(prefix.g2, g1), num_blocks)
    g3 = min(max(prefix.g3, g2), num_blocks)
    g4 = min(max(shared.g4, g3), num_blocks)
    g5 = min(max(shared.g5, g4), num_blocks)
    return (
        (g2 - g1) * config.onboard_cost_g2
        + (g3 - g2) * config.onboard_cost_g3
        + (g4 - g3) * config.onboard_cost_g4
        + (g5 - g4) * config.onboard_cost_g5
        + (num_blocks - g5)
    )


def worker_cost(
    worker: WorkerLoad,
    num_blocks: int,
    prefix: WorkerPrefix | None,
    shared: SharedPrefix,
    config: RouterConfig,
) -> float:
    prefill = worker.pending_prefill + blocks_to_prefill(num_blocks, prefix, shared, config)
    decode = worker.active_blocks + num_blocks
    return config.overlap_weight * prefill / worker.prefill_speed + decode / worker.decode_speed
