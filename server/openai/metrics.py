"""Prometheus metrics of the OpenAI frontend, registered in a registry the caller owns.

Every series carries the label `model` (the served model name). `strata_requests_total` adds `status`:
"success" (finished normally), "invalid" (4xx: bad request, unknown model), "rejected" (429: every wait queue
was full), "aborted" (client went away or the engine aborted it), "error" (5xx). Token counters and latency
histograms count engine requests, so a request with `n=4` counts four prompts' worth of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class FrontendMetrics:
    registry: CollectorRegistry
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    request_duration: Histogram
    requests: Counter
    in_flight: Gauge
    queued: Gauge
    queued_prompt_tokens: Gauge
    prompt_tokens: Counter
    cached_prompt_tokens: Counter
    generation_tokens: Counter
    kv_hit_rate: Gauge
    _token_totals: dict[str, tuple[int, int]] = field(default_factory=dict)  # model -> (prompt, cached)

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> FrontendMetrics:
        """Register the frontend's series in `registry` (a fresh one if None)."""
        reg = registry if registry is not None else CollectorRegistry()
        model = ("model",)
        return cls(
            registry=reg,
            time_to_first_token=Histogram(
                "strata_time_to_first_token_seconds",
                "Arrival to first generated token, seconds",
                model,
                buckets=_LATENCY_BUCKETS,
                registry=reg,
            ),
            inter_token_latency=Histogram(
                "strata_inter_token_latency_seconds",
                "Gap between consecutive engine outputs, seconds per token",
                model,
                buckets=_ITL_BUCKETS,
                registry=reg,
            ),
            request_duration=Histogram(
                "strata_request_duration_seconds",
                "Arrival to last token, seconds",
                model,
                buckets=_DURATION_BUCKETS,
                registry=reg,
            ),
            requests=Counter(
                "strata_requests", "Finished HTTP requests by status", ("model", "status"), registry=reg
            ),
            in_flight=Gauge(
                "strata_requests_in_flight", "Engine requests submitted and not finished", model, registry=reg
            ),
            queued=Gauge(
                "strata_requests_queued",
                "Engine requests submitted that have not produced a token yet",
                model,
                registry=reg,
            ),
            queued_prompt_tokens=Gauge(
                "strata_queued_prompt_tokens",
                "Prompt tokens of the engine requests that have not produced a token yet (the planner's "
                "backlog: load that no TTFT sample shows yet)",
                model,
                registry=reg,
            ),
            prompt_tokens=Counter(
                "strata_prompt_tokens", "Prompt tokens of finished engine requests", model, registry=reg
            ),
            cached_prompt_tokens=Counter(
                "strata_cached_prompt_tokens",
                "Prompt tokens whose KV came from cache (any tier)",
                model,
                registry=reg,
            ),
            generation_tokens=Counter("strata_generation_tokens", "Generated tokens", model, registry=reg),
            kv_hit_rate=Gauge(
                "strata_kv_cache_hit_rate",
                "cached_prompt_tokens_total / prompt_tokens_total since start (0..1)",
                model,
                registry=reg,
            ),
        )

    def record_tokens(self, model: str, prompt: int, cached: int, generated: int) -> None:
        """Count one finished engine request's tokens and refresh the hit rate."""
        self.prompt_tokens.labels(model).inc(prompt)
        self.cached_prompt_tokens.labels(model).inc(cached)
        self.generation_tokens.labels(model).inc(generated)
        total_prompt, total_cached = self._token_totals.get(model, (0, 0))
        total_prompt, total_cached = total_prompt + prompt, total_cached + cached
        self._token_totals[model] = (total_prompt, total_cached)
        if total_prompt > 0:
            self.kv_hit_rate.labels(model).set(total_cached / total_prompt)
