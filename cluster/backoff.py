"""The one doubling backoff: Redis reconnects, G5's circuit breaker and rank-group restarts wait by it."""

from __future__ import annotations


class Backoff:
    """A delay that starts at `base_s`, doubles on each `grow` up to `max_s`, and starts over on `reset`. Not
    thread-safe: its owner holds its own lock."""

    def __init__(self, base_s: float, max_s: float) -> None:
        self.base_s, self.max_s = base_s, max_s
        self.delay = base_s

    def grow(self) -> None:
        self.delay = min(self.delay * 2, self.max_s)

    def reset(self) -> None:
        self.delay = self.base_s
