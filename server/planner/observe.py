"""What the planner sees of a model's last interval, from Strata's own metrics (server/openai/metrics.py).

A `Snapshot` is the model's cumulative series at one moment, read from the frontend's registry (`RegistrySource`,
the planner inside `strata serve`) or scraped from its `/metrics` (`ScrapeSource`, `strata planner`). The
difference of two snapshots is an `Observation`:

    request_rate        first tokens per second: requests whose prefill ended in the interval
    prompt_tokens, output_tokens   means over the requests that finished in it (None: none finished)
    ttft_s, itl_s       means over its first tokens and its inter-token gaps (None: no sample)
    ttft_attainment     share of its first tokens within the TTFT target; itl_attainment: share of its token
                        gaps within the ITL target (both read off the histograms' buckets, linear inside the
                        bucket that holds the target)
    queued_requests, queued_prompt_tokens   requests submitted without a first token yet, now: the backlog
                        that no TTFT sample shows until it is served

A counter lower than before (the server restarted) counts from zero.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

TTFT = "strata_time_to_first_token_seconds"
ITL = "strata_inter_token_latency_seconds"
DURATION = "strata_request_duration_seconds"
_TOTALS = (
    f"{TTFT}_count", f"{TTFT}_sum", f"{ITL}_count", f"{ITL}_sum", f"{DURATION}_count",
    "strata_prompt_tokens_total", "strata_generation_tokens_total",
)  # fmt: skip
_GAUGES = ("strata_requests_queued", "strata_queued_prompt_tokens")


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One model's cumulative series at `at_s` (monotonic seconds): totals and gauges by sample name, and the
    cumulative bucket counts of the TTFT and ITL histograms as (upper bound seconds, count), sorted."""

    at_s: float
    values: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, families: Iterable[Metric], model: str, at_s: float) -> Snapshot:
        values: dict[str, float] = {}
        buckets: dict[str, dict[float, float]] = {TTFT: {}, ITL: {}}
        for family in families:
            for sample in family.samples:
                if sample.labels.get("model") != model:
                    continue
                if sample.name in _TOTALS or sample.name in _GAUGES:
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
                elif sample.name.endswith("_bucket") and sample.name[: -len("_bucket")] in buckets:
                    bounds = buckets[sample.name[: -len("_bucket")]]
                    le = float(sample.labels["le"])
                    bounds[le] = bounds.get(le, 0.0) + sample.value
        return cls(at_s, values, {name: tuple(sorted(b.items())) for name, b in buckets.items()})


@dataclass(frozen=True, slots=True)
class Observation:
    interval_s: float
    request_rate: float  # requests per second
    finished: float  # requests finished in the interval
    prompt_tokens: float | None
    output_tokens: float | None
    ttft_s: float | None
    itl_s: float | None
    ttft_attainment: float | None  # 0..1
    itl_attainment: float | None
    queued_requests: float
    queued_prompt_tokens: float

    @classmethod
    def between(
        cls, before: Snapshot, after: Snapshot, ttft_target_s: float, itl_target_s: float
    ) -> Observation:
        interval_s = max(after.at_s - before.at_s, 1e-9)

        def delta(name: str) -> float:
            now, then = after.values.get(name, 0.0), before.values.get(name, 0.0)
            return now if now < then else now - then  # lower than before: the server restarted

        first_tokens, gaps, finished = (
            delta(f"{TTFT}_count"),
            delta(f"{ITL}_count"),
            delta(f"{DURATION}_count"),
        )
        return cls(
            interval_s=interval_s,
            request_rate=first_tokens / interval_s,
            finished=finished,
            prompt_tokens=_mean(delta("strata_prompt_tokens_total"), finished),
            output_tokens=_mean(delta("strata_generation_tokens_total"), finished),
            ttft_s=_mean(delta(f"{TTFT}_sum"), first_tokens),
            itl_s=_mean(delta(f"{ITL}_sum"), gaps),
            ttft_attainment=_share_within(before.buckets.get(TTFT, ()), after.buckets.get(TTFT, ()), ttft_target_s),
            itl_attainment=_share_within(before.buckets.get(ITL, ()), after.buckets.get(ITL, ()), itl_target_s),
            queued_requests=after.values.get("strata_requests_queued", 0.0),
            queued_prompt_tokens=after.values.get("strata_queued_prompt_tokens", 0.0),
        )  # fmt: skip


class MetricsSource(Protocol):
    def snapshot(self, model: str) -> Snapshot:
        """The model's series now; raises OSError when they cannot be read."""
        ...


class RegistrySource:
    """The series of a registry in this process (the planner inside `strata serve`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def snapshot(self, model: str) -> Snapshot:
        return Snapshot.of(self.registry.collect(), model, time.monotonic())


class ScrapeSource:
    """The series of a Strata frontend's `/metrics` (Prometheus text), fetched over HTTP."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url
        self.timeout_s = timeout_s

    def snapshot(self, model: str) -> Snapshot:
        with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:  # noqa: S310 (operator's URL)
            text = response.read().decode()
        return Snapshot.of(text_string_to_metric_families(text), model, time.monotonic())


def _mean(total: float, count: float) -> float | None:
    return total / count if count > 0 else None


def _share_within(
    before: tuple[tuple[float, float], ...], after: tuple[tuple[float, float], ...], target: float
) -> float | None:
    """Share of the interval's samples at or under `target`, from cumulative bucket counts: linear inside the
    bucket that holds the target (samples past the last finite bound count as over it). None: no samples."""
    counts = dict(before)
    interval = [(le, count - counts.get(le, 0.0)) for le, count in after]
    if not interval or interval[-1][1] <= 0:
        return None
    total = interval[-1][1]  # the +Inf bucket
    lower_le, lower_count = 0.0, 0.0
    for le, count in interval:
        if target <= le:
            if le == float("inf"):
                return lower_count / total
            fraction = (target - lower_le) / (le - lower_le)
            return (lower_count + fraction * (count - lower_count)) / total
        lower_le, lower_count = le, count
    return lower_count / total
