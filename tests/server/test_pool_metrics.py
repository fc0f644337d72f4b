"""server/pool_metrics.py: each served LLM's KV pool and queues under vLLM's series names, read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from server.engine.api import PoolStats
from server.pool_metrics import PoolCollector


class _Engine:
    def __init__(self, stats: PoolStats | None) -> None:
        self._stats = stats

    def stats(self) -> PoolStats:
        if self._stats is None:
            raise RuntimeError("stopping")
        return self._stats


def _scrape(engines) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(PoolCollector(engines))
    rows = {}
    for line in generate_latest(registry).decode().splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            rows[name] = float(value)
    return rows


def test_usage_queues_and_preemptions_per_model_at_each_scrape() -> None:
    engines = {"a": _Engine(PoolStats(10, 4, 7, 3, 2, 5))}
    rows = _scrape(engines)
    assert (
        rows['strata_kv_cache_usage_perc{model="a"}'] == 0.6
    )  # 6 of 10 blocks referenced; cached free ones are not
    assert rows['strata_num_requests_running{model="a"}'] == 3
    assert rows['strata_num_requests_waiting{model="a"}'] == 2
    assert rows['strata_num_preemptions_total{model="a"}'] == 5
    engines["b"] = _Engine(PoolStats(8, 8, 0, 0, 0, 0))  # a model loaded later is in the next scrape
    assert _scrape(engines)['strata_kv_cache_usage_perc{model="b"}'] == 0.0


def test_a_model_whose_stats_fail_is_left_out_and_the_others_stay() -> None:
    rows = _scrape({"gone": _Engine(None), "a": _Engine(PoolStats(4, 0, 0, 1, 0, 0))})
    assert rows['strata_kv_cache_usage_perc{model="a"}'] == 1.0
    assert not any('model="gone"' in name for name in rows)
