"""The planner's Prometheus series (every one carries `model`):

strata_planner_desired_workers{model,role}       what the last decision asked for
strata_planner_workers{model,role}               what the connector reports running or starting
strata_planner_predicted_requests_per_second{model}
strata_planner_predicted_prompt_tokens{model}    mean prompt length predicted for the next interval
strata_planner_predicted_output_tokens{model}
strata_planner_observed_requests_per_second{model}
strata_planner_sla_attainment{model,target}      share of last interval's requests within the target:
                                                 target = ttft | itl (from the histograms' buckets)
strata_planner_decisions_total{model,role,direction}  direction = up | down | hold
strata_planner_leader{model}                     1 while this planner holds the lease
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass(slots=True)
class PlannerMetrics:
    desired_workers: Gauge
    workers: Gauge
    predicted_rate: Gauge
    predicted_prompt_tokens: Gauge
    predicted_output_tokens: Gauge
    observed_rate: Gauge
    sla_attainment: Gauge
    decisions: Counter
    leader: Gauge
    correction: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> PlannerMetrics:
        reg = registry if registry is not None else CollectorRegistry()
        model, role = ("model",), ("model", "role")
        return cls(
            desired_workers=Gauge(
                "strata_planner_desired_workers", "Workers the planner's last decision asked for", role,
                registry=reg,
            ),
            workers=Gauge(
                "strata_planner_workers", "Workers the connector reports serving or starting", role,
                registry=reg,
            ),
            predicted_rate=Gauge(
                "strata_planner_predicted_requests_per_second", "Predicted request rate, next interval", model,
                registry=reg,
            ),
            predicted_prompt_tokens=Gauge(
                "strata_planner_predicted_prompt_tokens", "Predicted mean prompt length, tokens", model,
                registry=reg,
            ),
            predicted_output_tokens=Gauge(
                "strata_planner_predicted_output_tokens", "Predicted mean output length, tokens", model,
                registry=reg,
            ),
            observed_rate=Gauge(
                "strata_planner_observed_requests_per_second", "Request rate over the last interval", model,
                registry=reg,
            ),
            sla_attainment=Gauge(
                "strata_planner_sla_attainment",
                "Share of the last interval's requests within the target (ttft, itl), 0..1",
                ("model", "target"),
                registry=reg,
            ),
            decisions=Counter(
                "strata_planner_decisions", "Planner decisions per role: up, down or hold",
                ("model", "role", "direction"), registry=reg,
            ),
            leader=Gauge(
                "strata_planner_leader", "1 while this planner holds the planner lease", model, registry=reg
            ),
            correction=Gauge(
                "strata_planner_correction",
                "Observed / profile latency factor the sizing uses (prefill: TTFT, decode: ITL)",
                ("model", "phase"),
                registry=reg,
            ),
        )  # fmt: skip
