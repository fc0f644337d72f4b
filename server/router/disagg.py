"""Conditional disaggregation: per request, prefill on a prefill worker or on the decode worker the router chose.

Roles (`WorkerInfo.role`): a `prefill` worker computes prompts and their first token, then hands the prompt's KV
to a decode worker (kvbm/transfer.py); a `decode` worker continues from such handoffs and prefills locally when
the rule says so; `both` is the aggregated worker. `RoutedEngine` routes decode and both workers with one
router and prefill workers with another, each KV-aware over its own workers.

The rule (Dynamo's conditional disaggregation): prefill remotely when the part of the prompt not cached on the
chosen decode worker is longer than `max_local_prefill_length` tokens and fewer than `max_prefill_queue_size`
remote prefills are in flight (sent to a prefill worker, not yet handed off), and a prefill worker is alive.
A short prompt (or a long one mostly cached on its decode worker) costs the decode worker little and a transfer
would cost more than it saves; a full prefill queue means the prefill workers are the bottleneck and waiting
for them would cost more than interleaving a prefill with the decode worker's decodes. Both thresholds may
change while serving (`set`: an SLA planner tunes them); every decision is counted by reason:

    remote / long_prompt        prefilled on a prefill worker
    local  / short_prompt       the uncached part is at most max_local_prefill_length
    local  / queue_full         max_prefill_queue_size remote prefills are in flight
    local  / no_prefill_worker  none is alive (all died or none joined yet): aggregated fallback
    local  / prefill_failed     the prefill workers refused it (full queues) or died while it was there
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """Thresholds of the rule: tokens, and remote prefills in flight (per model)."""

    max_local_prefill_length: int = 512
    max_prefill_queue_size: int = 4

    def __post_init__(self) -> None:
        if self.max_local_prefill_length < 0:
            raise ValueError(f"max_local_prefill_length must be >= 0, got {self.max_local_prefill_length}")
        if self.max_prefill_queue_size < 0:
            raise ValueError(f"max_prefill_queue_size must be >= 0, got {self.max_prefill_queue_size}")


class DisaggRule:
    """The rule with thresholds that may change at run time (any thread)."""

    def __init__(self, config: DisaggConfig | None = None) -> None:
        self._config = config or DisaggConfig()
        self._lock = threading.Lock()

    def set(
        self, max_local_prefill_length: int | None = None, max_prefill_queue_size: int | None = None
    ) -> None:
        """Change either threshold; ValueError for a negative one (nothing changes then)."""
        changes = {"max_local_prefill_length": max_local_prefill_length,
                   "max_prefill_queue_size": max_prefill_queue_size}  # fmt: skip
        with self._lock:
            self._config = dataclasses.replace(
                self._config, **{k: v for k, v in changes.items() if v is not None}
            )

    def thresholds(self) -> dict[str, int]:
        return dataclasses.asdict(self._config)

    def decide(self, uncached_tokens: int, queued: int, prefill_workers: int) -> tuple[bool, str]:
        """(remote, reason) for a prompt with `uncached_tokens` not cached on its decode worker, `queued` remote
        prefills in flight and `prefill_workers` alive."""
        config = self._config
        if prefill_workers == 0:
            return False, "no_prefill_worker"
        if uncached_tokens <= config.max_local_prefill_length:
            return False, "short_prompt"
        if queued >= config.max_prefill_queue_size:
            return False, "queue_full"
        return True, "long_prompt"
