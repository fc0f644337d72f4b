"""The local connector: `strata worker` processes on this host, which join the server through Redis
(`strata serve --accept-remote-workers`), and the planner's lease in that Redis.

Scaling up starts `python -m server worker --model-repository R --model M --role ROLE --redis-url U
--worker-id <model>-<role>-<planner pid>-<n> <worker_args>`; the worker loads, calibrates and registers, and the
server's discovery adds it. Scaling down sends SIGTERM to the newest worker of the role: it drains (its server
routes nothing new to it, it finishes its requests within its --exit-timeout-secs, what is left resumes elsewhere)
and exits; the connector no longer counts it from the signal on. A worker that died on its own is not counted
either, so the planner starts a new one at its next step.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

from cluster.redis_lease import Leases, LeaseState
from cluster.redis_link import RedisLink
from server.planner.connector import ROLES

log = logging.getLogger(__name__)


class LocalConnector:
    def __init__(
        self,
        model_repository: Path,
        model: str,
        redis_url: str,
        worker_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        exit_timeout_s: float = 30.0,
    ) -> None:
        """`worker_args`: more `strata worker` flags for every worker (engine overrides, KVBM tiers, the cluster
        secret file); `env`: their environment (default: this process's, which carries STRATA_CLUSTER_SECRET)."""
        self.model_repository = model_repository
        self.model = model
        self.redis_url = redis_url
        self.worker_args = list(worker_args)
        self.env = env
        self.exit_timeout_s = exit_timeout_s
        self._running: dict[str, list[subprocess.Popen]] = {role: [] for role in ROLES}
        self._draining: list[subprocess.Popen] = []
        self._started = 0
        self._lock = threading.Lock()

    def workers(self) -> dict[str, int]:
        with self._lock:
            self._reap()
            return {role: len(processes) for role, processes in self._running.items()}

    def scale(self, role: str, count: int) -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r}: expected one of {', '.join(ROLES)}")
        if count < 0:
            raise ValueError(f"cannot scale {role} workers to {count}")
        with self._lock:
            self._reap()
            running = self._running[role]
            while len(running) < count:
                running.append(self._start(role))
            while len(running) > count:
                self._drain(running.pop())

    def close(self, stop_workers: bool = False) -> None:
        """With `stop_workers`, drain every worker it started and wait for them (up to their exit timeout)."""
        if not stop_workers:
            return
        with self._lock:
            for processes in self._running.values():
                while processes:
                    self._drain(processes.pop())
            draining, self._draining = self._draining, []
        for process in draining:
            try:
                process.wait(self.exit_timeout_s + 10)
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d did not exit after draining; killing it", process.pid)
                process.kill()
                process.wait()

    def _start(self, role: str) -> subprocess.Popen:
        self._started += 1
        worker_id = f"{self.model}-{role}-{os.getpid()}-{self._started}"
        command = [
            sys.executable, "-m", "server", "worker", "--model-repository", str(self.model_repository),
            "--model", self.model, "--role", role, "--redis-url", self.redis_url, "--worker-id", worker_id,
            "--host", "127.0.0.1", "--exit-timeout-secs", str(int(self.exit_timeout_s)), *self.worker_args,
        ]  # fmt: skip
        process = subprocess.Popen(command, env=self.env)
        log.info("started %s worker %s (pid %d)", role, worker_id, process.pid)
        return process

    def _drain(self, process: subprocess.Popen) -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # the worker drains, then exits
            log.info("draining worker pid %d", process.pid)
        self._draining.append(process)

    def _reap(self) -> None:
        """Forget workers that exited: drained ones, and ones that died (logged)."""
        self._draining = [p for p in self._draining if p.poll() is None]
        for role, processes in self._running.items():
            for process in [p for p in processes if p.poll() is not None]:
                log.warning("%s worker pid %d exited with code %s", role, process.pid, process.returncode)
                processes.remove(process)


class RedisLeadership:
    """The planner lease in Redis: key `strata:planner-lease:<model>`, held for `lease_s` and renewed at each
    step (a planner steps more often than its lease lasts: lease_s should exceed the adjustment interval)."""

    def __init__(self, redis_url: str, model: str, lease_s: float, identity: str | None = None) -> None:
        self.key = f"strata:planner-lease:{model}"
        self.identity = identity or f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.lease_ms = int(lease_s * 1000)
        self._link = RedisLink(redis_url)
        self._leases = Leases(self._link.client)

    def is_leader(self) -> bool:
        """Take the lease if it is free, or renew it if it is ours; False if another planner holds it or Redis is
        unreachable."""
        state = self._link.call(
            lambda _: self._leases.renew([self.key], self.identity, self.lease_ms)[0],
            LeaseState.HELD_BY_OTHER,
        )
        return state is not LeaseState.HELD_BY_OTHER

    def release(self) -> None:
        """Free the lease if this planner still holds it."""
        self._link.call(lambda _: self._leases.release(self.key, self.identity), False)
        self._link.close()
