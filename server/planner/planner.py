"""The SLA planner's loop: every interval, observe the model's last interval, predict the next one, size the
workers that meet the TTFT and ITL targets on the worker profile, and have the connector run that many.

    observe   Observation.between(last snapshot, this one)            observe.py
    predict   one predictor per series: request rate, prompt and output lengths   predict.py
    size      disaggregated_workers / aggregated_workers on the profile  sizing.py
    act       connector.scale per role, only while this planner holds the lease   connector.py

Queued prompt tokens beyond what the arrival rate explains (at rate r meeting the TTFT target, r x target requests
wait for their first token: Little's law) go into the load as they are, never predicted away: a burst that queues
requests scales prefill up in the interval it arrives, before any TTFT sample reports it.

Corrections (as Dynamo's planner makes them): a deployment is rarely as fast as its profile, which measured one
worker alone (an aggregated worker's decode steps wait for prefill chunks; other processes share the host). Each
interval compares what was observed with what the profile predicts for that load on the workers there were:

    prefill   observed mean TTFT / (profile TTFT + the M/D/1 wait at the observed rate), when utilisation < 0.9
    decode    observed mean ITL / profile ITL at the streams each worker ran (Little's law: rate x output x ITL)

and sizes on the profile scaled by them (each factor smoothed, half old and half new, within CORRECTION_RANGE).

The rate the next interval is sized for is the predictor's, or the last interval's when that is higher; an
interval counts toward a scale-down when the lower of the two needs fewer workers (`follow_last`): a ramp is acted
on in the interval it shows, up or down. Scaling up happens at once; scaling down by one worker per role, and
only once the need has been under the count for `scale_down_intervals` intervals in a row (a stabilisation
window, as Kubernetes' HPA has): a worker costs its start-up (model load, calibration) every time it comes back,
and at low rates one interval's count of arrivals is mostly noise.

With disaggregated workers and a `DisaggControl`, the planner also tunes the conditional-disaggregation
thresholds (server/router/disagg.py):
    max_prefill_queue_size     PREFILL_QUEUE_PER_WORKER remote prefills per prefill worker it asks for
    max_local_prefill_length   halved (not under MIN_LOCAL_PREFILL) when ITL attainment falls under
                               ATTAINMENT_LOW (local prefills stall the decode workers' streams); doubled (not
                               over MAX_LOCAL_PREFILL) when TTFT attainment is under ATTAINMENT_LOW while ITL
                               attainment is at least ATTAINMENT_HIGH (the decode workers have room to prefill)

Every decision is one log line with its inputs, and the planner's series (metrics.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from dataclasses import dataclass

from server.controls import DisaggControl
from server.planner.connector import Leadership, WorkerConnector
from server.planner.metrics import PlannerMetrics
from server.planner.observe import MetricsSource, Observation, Snapshot
from server.planner.predict import make_predictor
from server.planner.sizing import (
    Bounds,
    Load,
    Targets,
    WorkerCounts,
    WorkerProfile,
    aggregated_workers,
    disaggregated_workers,
)

log = logging.getLogger(__name__)

PREFILL_QUEUE_PER_WORKER = 4
ATTAINMENT_LOW, ATTAINMENT_HIGH = 0.9, 0.98
MIN_LOCAL_PREFILL, MAX_LOCAL_PREFILL = 64, 1 << 15
CORRECTION_RANGE = (0.5, 4.0)


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    model: str
    targets: Targets
    bounds: Bounds
    interval_s: float = 30.0
    predictor: str = "moving_average"
    disaggregated: bool = True  # prefill and decode workers; False: aggregated ("both") workers
    correct: bool = True  # scale the profile by the observed/predicted latency ratios
    scale_down_intervals: int = 3  # intervals in a row the need must stay under the count before one goes
    follow_last: bool = True  # the last interval's rate, where it is higher or lower (see _predict)


@dataclass(frozen=True, slots=True)
class Decision:
    """One interval's decision and what it was made from."""

    observed: Observation
    load: Load  # predicted for the next interval (queued tokens as observed)
    counts: WorkerCounts
    before: dict[str, int]  # workers per role when deciding
    after: dict[str, int]  # what the planner asked for (== before when not leader)
    leader: bool
    thresholds: dict[str, int] | None  # conditional-disaggregation thresholds set, if any
    correction: dict[str, float]  # the profile's factors used: prefill (TTFT), decode (ITL)

    def describe(self, model: str) -> str:
        o, load, c = self.observed, self.load, self.counts
        return (
            f"planner {model}: observed {o.request_rate:.2f} req/s, prompt {_fmt(o.prompt_tokens)}, output "
            f"{_fmt(o.output_tokens)}, ttft {_fmt(o.ttft_s, '.3f')} s ({_pct(o.ttft_attainment)} in target), "
            f"itl {_fmt(o.itl_s, '.4f')} s ({_pct(o.itl_attainment)}), queued {o.queued_requests:.0f} req / "
            f"{o.queued_prompt_tokens:.0f} tok -> predicted {load.request_rate:.2f} req/s, prompt "
            f"{load.prompt_tokens:.0f}, output {load.output_tokens:.0f} -> need prefill {c.prefill_need:.2f}, "
            f"decode {c.decode_need:.2f} ({c.reason}; profile x{self.correction['prefill']:.2f} prefill, "
            f"x{self.correction['decode']:.2f} decode); workers {self.before} -> {self.after}"
            + ("" if self.leader else " (not leader: not acting)")
            + (f"; thresholds {self.thresholds}" if self.thresholds else "")
        )


class Planner:
    def __init__(
        self,
        config: PlannerConfig,
        profile: WorkerProfile,
        source: MetricsSource,
        connector: WorkerConnector,
        metrics: PlannerMetrics,
        leadership: Leadership | None = None,
        thresholds: DisaggControl | None = None,
    ) -> None:
        """`leadership` None: this planner is the only one. `thresholds`: tune conditional disaggregation."""
        self.config = config
        self.profile = profile
        self.source = source
        self.connector = connector
        self.metrics = metrics
        self.leadership = leadership
        self.thresholds = thresholds
        self.predictors = {
            series: make_predictor(config.predictor) for series in ("rate", "prompt", "output")
        }
        self.roles = ("prefill", "decode") if config.disaggregated else ("both",)
        self.correction = {"prefill": 1.0, "decode": 1.0}
        self._under = dict.fromkeys(
            self.roles, 0
        )  # intervals in a row each role had more workers than needed
        self._last: Snapshot | None = None

    def step(self) -> Decision | None:
        """One interval. None the first time (it only takes the baseline snapshot) and when the metrics cannot be
        read (logged; the next step measures from the last snapshot read)."""
        try:
            snapshot = self.source.snapshot(self.config.model)
        except OSError as exc:
            log.warning("planner %s: cannot read the metrics: %s", self.config.model, exc)
            return None
        last, self._last = self._last, snapshot
        if last is None:
            self._ensure_minimum()
            return None
        observed = Observation.between(last, snapshot, self.config.targets.ttft_s, self.config.targets.itl_s)
        before = self._workers()
        if self.config.correct and before is not None:
            self._correct(observed, before)
        load, low = self._predict(observed)
        counts = self._size(load)
        fewest = self._size(low) if low != load else counts
        leader = self.leadership is None or self.leadership.is_leader()
        after = self._act(counts, fewest, before) if leader and before is not None else dict(before or {})
        thresholds = self._tune(observed, counts) if leader else None
        decision = Decision(
            observed, load, counts, before or {}, after, leader, thresholds, dict(self.correction)
        )
        self._export(decision)
        log.info("%s", decision.describe(self.config.model))
        return decision

    def run(self, stop: threading.Event) -> None:
        """Step every interval until `stop` is set; then give the lease up."""
        try:
            while not stop.is_set():
                try:
                    self.step()
                except Exception:  # a bug in one step must not end planning: logged, the next step runs
                    log.exception("planner %s: step failed", self.config.model)
                stop.wait(self.config.interval_s)
        finally:
            if self.leadership is not None:
                self.leadership.release()

    def _ensure_minimum(self) -> None:
        """At the first step, with nothing observed yet: bring each role up to its minimum (a server started with
        no workers of its own serves as soon as the first one joins)."""
        if self.leadership is not None and not self.leadership.is_leader():
            return
        before = self._workers()
        if before is None:
            return
        bounds = self.config.bounds
        minimum = {"prefill": bounds.min_prefill, "decode": bounds.min_decode, "both": bounds.min_decode}
        for role in self.roles:
            if before.get(role, 0) < minimum[role]:
                try:
                    self.connector.scale(role, minimum[role])
                except Exception as exc:
                    log.error("planner %s: starting the minimum %s workers failed: %s", self.config.model, role,
                              exc)  # fmt: skip

    def _predict(self, observed: Observation) -> tuple[Load, Load]:
        """(the load to size for, the lowest estimate of it: what a scale-down interval is counted on)."""
        rate, prompt, output = (self.predictors[s] for s in ("rate", "prompt", "output"))
        rate.add(observed.request_rate)
        if observed.prompt_tokens is not None:
            prompt.add(observed.prompt_tokens)
        if observed.output_tokens is not None:
            output.add(observed.output_tokens)
        prompt_tokens = prompt.predict()
        if prompt_tokens <= 0 and observed.queued_requests > 0:  # nothing finished yet: the backlog's mean
            prompt_tokens = observed.queued_prompt_tokens / observed.queued_requests
        prompt_tokens = max(prompt_tokens, 1.0)
        # Requests waiting for their first token are normal: at rate r meeting the TTFT target, r x target of them
        # are (Little's law), and the rate already counts them. Only what queues beyond that is a backlog to clear.
        usual = observed.request_rate * self.config.targets.ttft_s * prompt_tokens
        # A predictor averaging past intervals lags a changing load by half its window (a moving average of 4
        # intervals by 1.5 of them): on a rise while the SLA is being missed, on a fall while a worker idles. The
        # last interval's rate, when higher, is what the next one is sized for; when lower, it is what an interval
        # is counted on toward a scale-down, which still needs `scale_down_intervals` such intervals in a row.
        predicted = rate.predict()
        load = Load(
            request_rate=max(predicted, observed.request_rate) if self.config.follow_last else predicted,
            prompt_tokens=prompt_tokens,
            output_tokens=max(output.predict(), 1.0),
            queued_prompt_tokens=max(0.0, observed.queued_prompt_tokens - usual),
        )
        if not self.config.follow_last or observed.request_rate >= predicted:
            return load, load
        return load, dataclasses.replace(load, request_rate=observed.request_rate)

    def _correct(self, observed: Observation, workers: dict[str, int]) -> None:
        prompt, output = observed.prompt_tokens, observed.output_tokens
        if prompt is None or output is None:
            return
        prefill_workers = workers.get("prefill" if self.config.disaggregated else "both", 0)
        decode_workers = workers.get("decode" if self.config.disaggregated else "both", 0)
        if observed.ttft_s is not None and prefill_workers > 0:
            service = self.profile.ttft(prompt)
            rho = observed.request_rate * service / prefill_workers
            if service > 0 and rho < 0.9:  # past that the wait is the queue's, not the worker's speed
                self._update("prefill", observed.ttft_s / (service + rho * service / (2 * (1 - rho))))
        if observed.itl_s is not None and decode_workers > 0:
            streams = observed.request_rate * output * observed.itl_s / decode_workers  # Little's law
            expected = self.profile.itl_at(streams, prompt + output / 2)
            if expected > 0:
                self._update("decode", observed.itl_s / expected)

    def _update(self, phase: str, sample: float) -> None:
        low, high = CORRECTION_RANGE
        self.correction[phase] = min(high, max(low, (self.correction[phase] + sample) / 2))

    def _size(self, load: Load) -> WorkerCounts:
        size = disaggregated_workers if self.config.disaggregated else aggregated_workers
        profile = self.profile.scaled(self.correction["prefill"], self.correction["decode"])
        return size(profile, load, self.config.targets, self.config.bounds, self.config.interval_s)

    def _workers(self) -> dict[str, int] | None:
        """Workers of the planned roles, or None (logged) when the connector cannot count them."""
        try:
            counts = self.connector.workers()
            return {role: counts.get(role, 0) for role in self.roles}
        except Exception as exc:  # a connector's failure (API, processes) must not stop the planner
            log.error("planner %s: cannot count the workers: %s", self.config.model, exc)
            return None

    def _act(self, counts: WorkerCounts, fewest: WorkerCounts, before: dict[str, int]) -> dict[str, int]:
        """Up to `counts` at once; down by one after `scale_down_intervals` intervals in a row whose `fewest` (the
        lowest estimate of the load) was under the count."""
        wanted = {"prefill": counts.prefill, "decode": counts.decode, "both": counts.decode}
        lowest = {"prefill": fewest.prefill, "decode": fewest.decode, "both": fewest.decode}
        after = dict(before)
        for role in self.roles:
            now = before.get(role, 0)
            self._under[role] = self._under[role] + 1 if lowest[role] < now else 0
            if wanted[role] > now:
                target = wanted[role]
            elif self._under[role] >= self.config.scale_down_intervals:
                target, self._under[role] = now - 1, 0  # down one at a time, after the window
            else:
                continue
            try:
                self.connector.scale(role, target)
                after[role] = target
            except Exception as exc:
                log.error("planner %s: scaling %s workers %d -> %d failed: %s", self.config.model, role, now,
                          target, exc)  # fmt: skip
        return after

    def _tune(self, observed: Observation, counts: WorkerCounts) -> dict[str, int] | None:
        if self.thresholds is None or not self.config.disaggregated:
            return None
        try:
            current = self.thresholds.thresholds()
        except (OSError, ValueError) as exc:  # the frontend is away: the next step tries again
            log.warning("planner %s: cannot read the disaggregation thresholds: %s", self.config.model, exc)
            return None
        length = current["max_local_prefill_length"]
        ttft_ok, itl_ok = observed.ttft_attainment, observed.itl_attainment
        if itl_ok is not None and itl_ok < ATTAINMENT_LOW:
            length = max(MIN_LOCAL_PREFILL, length // 2)
        elif (
            ttft_ok is not None
            and itl_ok is not None
            and ttft_ok < ATTAINMENT_LOW
            and itl_ok >= ATTAINMENT_HIGH
        ):
            length = min(MAX_LOCAL_PREFILL, length * 2)
        queue = max(1, PREFILL_QUEUE_PER_WORKER * counts.prefill)
        wanted = {"max_local_prefill_length": length, "max_prefill_queue_size": queue}
        if wanted != current:
            try:
                self.thresholds.set(**wanted)
            except (OSError, ValueError) as exc:
                log.warning(
                    "planner %s: cannot set the disaggregation thresholds: %s", self.config.model, exc
                )
                return None
        return wanted

    def _export(self, decision: Decision) -> None:
        m, model = self.metrics, self.config.model
        desired = {
            "prefill": decision.counts.prefill,
            "decode": decision.counts.decode,
            "both": decision.counts.decode,
        }
        for role in self.roles:
            m.desired_workers.labels(model, role).set(desired[role])
            m.workers.labels(model, role).set(decision.before.get(role, 0))
            change = decision.after.get(role, 0) - decision.before.get(role, 0)
            m.decisions.labels(model, role, "up" if change > 0 else "down" if change < 0 else "hold").inc()
        m.predicted_rate.labels(model).set(decision.load.request_rate)
        m.predicted_prompt_tokens.labels(model).set(decision.load.prompt_tokens)
        m.predicted_output_tokens.labels(model).set(decision.load.output_tokens)
        m.observed_rate.labels(model).set(decision.observed.request_rate)
        for target, share in (
            ("ttft", decision.observed.ttft_attainment),
            ("itl", decision.observed.itl_attainment),
        ):
            if share is not None:
                m.sla_attainment.labels(model, target).set(share)
        m.leader.labels(model).set(1 if decision.leader else 0)
        for phase, factor in decision.correction.items():
            m.correction.labels(model, phase).set(factor)


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"
