"""What an operator or the SLA planner may change on a model while it serves, as protocols: the OpenAI frontend's
admin routes and the planner hold these, whatever object implements them (server/router/disagg.py does)."""

from __future__ import annotations

from typing import Protocol


class DisaggControl(Protocol):
    """The thresholds of conditional disaggregation (server/router/disagg.py), which may change while serving: an
    engine served disaggregated has one as its `disagg` attribute (None or absent otherwise)."""

    def thresholds(self) -> dict[str, int]:
        """{"max_local_prefill_length": tokens, "max_prefill_queue_size": remote prefills in flight}"""
        ...

    def set(
        self, max_local_prefill_length: int | None = None, max_prefill_queue_size: int | None = None
    ) -> None:
        """Change either threshold; ValueError for a negative one."""
        ...
