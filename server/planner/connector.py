"""What the planner scales through: one `WorkerConnector` per place workers run, one file each.

    local.py        `strata worker` processes on this host (lease in Redis)
    kubernetes.py   the prefill/decode Deployments of a Kubernetes namespace (Kubernetes Lease)

Roles are those of `WorkerInfo.role`: "prefill", "decode", or "both" (aggregated workers). A connector never
kills a request: removing a worker is a SIGTERM, and a worker drains on SIGTERM (it tells its server, which routes
nothing new to it, finishes what it holds within `--exit-timeout-secs`, then leaves; what is left migrates).
"""

from __future__ import annotations

from typing import Protocol

ROLES = ("prefill", "decode", "both")


class WorkerConnector(Protocol):
    def workers(self) -> dict[str, int]:
        """Workers per role that serve or are starting (draining ones not counted); every role it manages is a
        key."""
        ...

    def scale(self, role: str, count: int) -> None:
        """Have `count` workers of `role`: start the missing ones, or drain and stop the surplus. Returns once the
        change is under way, not when it has finished."""
        ...

    def close(self) -> None:
        """Stop acting (workers it started keep running unless the connector's docstring says otherwise)."""
        ...


class Leadership(Protocol):
    """Only one planner acts at a time: the one that holds the lease."""

    def is_leader(self) -> bool:
        """Take or renew the lease if free or ours; True while this planner holds it. Never raises: an
        unreachable lease store is not leadership."""
        ...

    def release(self) -> None:
        """Give the lease up (planner stopping), so another planner can take it at once."""
        ...
