"""Says loudly when the KV index stops receiving events while requests that should produce them keep coming.

Dynamo users lost hours to an index that stayed silently empty because events were misconfigured
(ai-dynamo/dynamo#2924): every decision fell back to load balancing and nothing said so.
"""

from __future__ import annotations

import logging

from prometheus_client import Gauge

logger = logging.getLogger(__name__)


class StalenessCheck:
    """Stale = a request that must store new blocks was routed over `stale_after_s` ago and no event came since."""

    def __init__(self, stale_after_s: float, gauge: Gauge) -> None:
        self.stale_after_s = stale_after_s
        self.stale = False
        self._gauge = gauge
        self._events_seen = -1
        self._waiting_since: float | None = None

    def observe(self, events_applied: int, now: float, expects_events: bool) -> None:
        """Called per routed request with the index's event count; `expects_events`: it will store blocks."""
        if events_applied != self._events_seen:
            self._events_seen = events_applied
            self._waiting_since = now if expects_events else None
            self._set(False)
        elif self._waiting_since is None:
            if expects_events:
                self._waiting_since = now
        elif now - self._waiting_since > self.stale_after_s:
            self._set(True)

    def _set(self, stale: bool) -> None:
        if stale == self.stale:
            return
        self.stale = stale
        self._gauge.set(int(stale))
        if stale:
            logger.warning(
                "KV index is stale: no block event for %.0f s while requests kept coming; cache "
                "locality of routing decisions is out of date (are workers publishing KV events?)",
                self.stale_after_s,
            )
        else:
            logger.info("KV index is receiving events again")
