"""`strata worker --metrics-port`: the worker's health and metrics over HTTP, for Kubernetes probes and scrapes.

    GET /v2/health/live, /health   200 while the engine can take requests (its thread is alive), else 503
    GET /v2/health/ready           200 while it is also registered and not draining (after SIGTERM), else 503
    GET /metrics                   its engine's pool and queues (server/pool_metrics.py) and its KVBM tiers

Triton's route names for the probes, vLLM's `/health`; the port is bound once the model is loaded and calibrated,
so a probe that connects sees a loaded worker.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from server.engine.api import LocalEngine
from server.pool_metrics import PoolCollector
from server.status_http import StatusServer


class WorkerStatus:
    def __init__(
        self,
        address: str,
        port: int,
        engine: LocalEngine,
        ready: Callable[[], bool],
        registries: Sequence[CollectorRegistry] = (),
    ) -> None:
        """`ready`: registered and not draining; `registries`: more series to serve (the KVBM tiers'). Binds
        `address:port` now (OSError if taken)."""
        self.engine = engine
        self._ready = ready
        pool = CollectorRegistry()
        pool.register(PoolCollector({engine.model_name: engine}))
        self._registries = [pool, *registries]
        live = self._probe(lambda: engine.healthy, "live")
        routes = {
            "/health": live,
            "/v2/health/live": live,
            "/v2/health/ready": self._probe(self._is_ready, "ready"),
        }
        self._server = StatusServer(
            address, port, {**routes, "/metrics": self._metrics}, "strata-worker-status"
        )
        self.port = self._server.port

    def start(self) -> None:
        self._server.start()

    def close(self) -> None:
        self._server.close()

    def _is_ready(self) -> bool:
        return self.engine.healthy and self._ready()

    @staticmethod
    def _probe(check: Callable[[], bool], name: str) -> Callable[[], tuple[int, bytes, str]]:
        def probe() -> tuple[int, bytes, str]:
            ok = check()
            body = json.dumps({name: ok}).encode()
            return (200 if ok else 503), body, "application/json"

        return probe

    def _metrics(self) -> tuple[int, bytes, str]:
        return 200, b"".join(generate_latest(registry) for registry in self._registries), CONTENT_TYPE_LATEST
