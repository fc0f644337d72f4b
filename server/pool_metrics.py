"""Each served LLM's KV pool and queues as Prometheus series, read from `Engine.stats()` when scraped.

vLLM's names (what dashboards built for vLLM expect) under Strata's prefix, each with the label `model`:
`strata_kv_cache_usage_perc` (0..1: blocks referenced by a request / blocks in the pool, vLLM's
`vllm:kv_cache_usage_perc`), `strata_num_requests_running`, `strata_num_requests_waiting` and
`strata_num_preemptions_total` (sequences preempted since the engine started). A routed engine reports the sums
over its live workers' last heartbeats, so these are at most one heartbeat old there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.engine.api import Engine, PoolStats

log = logging.getLogger(__name__)


class PoolCollector(Collector):
    def __init__(self, engines: Mapping[str, Engine]) -> None:
        """`engines`: served name -> engine, read at each scrape (models may come and go)."""
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        usage = GaugeMetricFamily(
            "strata_kv_cache_usage_perc",
            "KV pool blocks referenced by requests / blocks (0..1)",
            labels=["model"],
        )
        running = GaugeMetricFamily("strata_num_requests_running", "Sequences running", labels=["model"])
        waiting = GaugeMetricFamily("strata_num_requests_waiting", "Sequences waiting", labels=["model"])
        preemptions = CounterMetricFamily(
            "strata_num_preemptions", "Sequences preempted (blocks freed, recomputed later)", labels=["model"]
        )
        ranks = _RankFamilies()
        for name, engine in list(self.engines.items()):
            try:
                stats = engine.stats()
            except Exception:  # a model stopping while scraped: its series are left out of this scrape
                log.debug("stats of %s not read", name, exc_info=True)
                continue
            used = stats.num_blocks - stats.num_free_blocks
            usage.add_metric([name], used / stats.num_blocks if stats.num_blocks else 0.0)
            running.add_metric([name], stats.num_running)
            waiting.add_metric([name], stats.num_waiting)
            preemptions.add_metric([name], stats.num_preemptions)
            ranks.add(name, stats)
        yield from (usage, running, waiting, preemptions, *ranks.families())


class _RankFamilies:
    """Sharded engines' series: each rank's state, memory and compute time, and the groups' restarts."""

    def __init__(self) -> None:
        labels = ["model", "worker", "rank"]
        self.up = GaugeMetricFamily(
            "strata_rank_up", "1 while the rank serves, 0 while its group restarts", labels=labels
        )
        self.memory = GaugeMetricFamily(
            "strata_rank_resident_memory_bytes", "Resident memory of the rank's process", labels=labels
        )
        self.busy = CounterMetricFamily(
            "strata_rank_busy_seconds", "Seconds the rank spent computing steps (not waiting on its peers)",
            labels=labels,
        )  # fmt: skip
        self.restarts = CounterMetricFamily(
            "strata_worker_restarts",
            "Times a sharded worker's rank group was restarted, by what ended it (the rank's signal, exit code, "
            "heartbeat, step_failed, start_failed)",
            labels=["model", "reason"],
        )

    def add(self, model: str, stats: PoolStats) -> None:
        for rank in stats.ranks:
            labels = [model, rank.worker, str(rank.rank)]
            self.up.add_metric(labels, 1.0 if rank.up else 0.0)
            self.memory.add_metric(labels, rank.rss_bytes)
            self.busy.add_metric(labels, rank.busy_s)
        for reason, count in stats.restarts.items():
            self.restarts.add_metric([model, reason], count)

    def families(self) -> tuple[Metric, ...]:
        return self.up, self.memory, self.busy, self.restarts
