"""The messages and reports that cross between the server (router) and its workers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

WorkerId = NewType("WorkerId", str)  # the same id the worker's KVBM agent publishes events under


@dataclass(slots=True)
class WorkerStats:
    """A worker's self-report. Speeds are measured throughput (0 = not measured yet, treated as average)."""

    worker_id: WorkerId
    kv_capacity_blocks: int
    active_blocks: int = 0  # KV blocks held by running requests (decode load)
    in_flight: int = 0  # requests running or queued
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
