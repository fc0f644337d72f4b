"""server/workers/status.py: a worker's probes follow its engine and its draining; /metrics has its pool series."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from server.workers.status import WorkerStatus
from tests.workers.worker_fakes import StepEngine


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_probes_follow_the_engine_and_the_drain_and_metrics_name_the_model() -> None:
    engine = StepEngine()
    draining = threading.Event()
    tiers = CollectorRegistry()
    Counter("kvbm_hits", "blocks found", ["tier"], registry=tiers).labels("G2").inc(3)
    status = WorkerStatus("127.0.0.1", 0, engine, lambda: not draining.is_set(), [tiers])
    status.start()
    try:
        assert _get(status.port, "/v2/health/ready") == (200, json.dumps({"ready": True}))
        assert _get(status.port, "/health")[0] == _get(status.port, "/v2/health/live")[0] == 200
        draining.set()  # SIGTERM: no longer ready, still alive (its requests finish)
        assert _get(status.port, "/v2/health/ready")[0] == 503
        assert _get(status.port, "/v2/health/live")[0] == 200
        engine.healthy = False  # the engine thread died
        assert _get(status.port, "/health")[0] == 503
        code, text = _get(status.port, "/metrics")
        assert code == 200 and 'strata_kv_cache_usage_perc{model="step"}' in text
        assert 'kvbm_hits_total{tier="G2"} 3.0' in text
        assert _get(status.port, "/v2/models")[0] == 404
    finally:
        status.close()
