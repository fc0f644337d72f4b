"""The planner on recorded metrics: Prometheus text as the frontend writes it, two snapshots at a time, with every
expected number worked out by hand in the comments. No server, no workers: a fake connector records the scaling."""

from __future__ import annotations

import http.server
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from harness.servers import run_cli
from server.openai.metrics import FrontendMetrics
from server.planner.metrics import PlannerMetrics
from server.planner.observe import Observation, RegistrySource, ScrapeSource, Snapshot
from server.planner.planner import Planner, PlannerConfig
from server.planner.predict import Arima, Auto, Constant, MovingAverage, make_predictor
from server.planner.sizing import Bounds, DecodePoint, PrefillPoint, Targets, WorkerProfile

MODEL = "m"
TARGETS = Targets(ttft_s=1.0, itl_s=0.05)
# prefill: 0.5 s for 1000 tokens; rho_max = 2 (1 - 0.5) / (2 - 0.5) = 2/3, so one worker carries
# 2/3 * 1000 / 0.5 = 1333.3 prompt tokens/s. decode: 8 streams at 0.04 s = 200 tok/s per worker (16 at 0.08 misses).
PROFILE = WorkerProfile(
    prefill=(PrefillPoint(1000, 0.5), PrefillPoint(2000, 1.0)),
    decode=(DecodePoint(8, 1000, 0.04), DecodePoint(16, 1000, 0.08), DecodePoint(8, 2000, 0.04)),
)


def frontend(
    first_tokens: int, finished: int, prompt: int, generated: int, ttft: list[float], itl: list[float],
    queued: int = 0, queued_prompt: int = 0,
) -> Snapshot:  # fmt: skip
    """The frontend's series after these requests, as /metrics text parsed back (what a scrape reads)."""
    metrics = FrontendMetrics.create(CollectorRegistry())
    for seconds in ttft:
        metrics.time_to_first_token.labels(MODEL).observe(seconds)
    for seconds in itl:
        metrics.inter_token_latency.labels(MODEL).observe(seconds)
    for _ in range(finished):
        metrics.request_duration.labels(MODEL).observe(1.0)
    metrics.prompt_tokens.labels(MODEL).inc(prompt)
    metrics.generation_tokens.labels(MODEL).inc(generated)
    metrics.queued.labels(MODEL).set(queued)
    metrics.queued_prompt_tokens.labels(MODEL).set(queued_prompt)
    metrics.prompt_tokens.labels("other-model").inc(10**6)  # another model's series are not this one's
    text = generate_latest(metrics.registry).decode()
    assert first_tokens == len(ttft)
    return Snapshot.of(text_string_to_metric_families(text), MODEL, at_s=0.0)


def at(snapshot: Snapshot, seconds: float) -> Snapshot:
    return Snapshot(seconds, snapshot.values, snapshot.buckets)


def test_observation_between_two_scrapes() -> None:
    before = at(frontend(2, 2, 2000, 100, [0.3, 0.3], [0.02] * 4), 0.0)
    # 10 s later: 8 more first tokens (TTFT 0.3 x4, 0.75 x2, 3.0 x2), 4 more finished with 4000 prompt and
    # 200 generated tokens, 10 more gaps (0.02 x8, 0.06 x2); 3 requests queued with 4500 prompt tokens.
    after = at(
        frontend(10, 6, 6000, 300, [0.3] * 6 + [0.75] * 2 + [3.0] * 2, [0.02] * 12 + [0.06] * 2, 3, 4500),
        10.0,
    )
    o = Observation.between(before, after, TARGETS.ttft_s, TARGETS.itl_s)
    assert o.interval_s == 10.0
    assert o.request_rate == pytest.approx(0.8)  # 8 first tokens / 10 s
    assert (o.finished, o.prompt_tokens, o.output_tokens) == (4, 1000, 50)  # 4000 / 4, 200 / 4
    assert o.ttft_s == pytest.approx((0.3 * 4 + 0.75 * 2 + 3.0 * 2) / 8)
    # TTFT buckets ... 0.5, 1.0, 2.5, 5.0: the target 1.0 is a bound; 6 of the 8 are under it
    assert o.ttft_attainment == pytest.approx(6 / 8)
    # ITL buckets 0.025, 0.05, 0.075: 8 gaps <= 0.025, 2 in (0.05, 0.075]; 8 of 10 within 0.05
    assert o.itl_attainment == pytest.approx(8 / 10)
    assert (o.queued_requests, o.queued_prompt_tokens) == (3, 4500)


def test_attainment_inside_a_bucket_is_linear() -> None:
    # 4 samples in (0.5, 1.0]; a target of 0.75 is halfway through that bucket: 2 of them count
    empty, four = at(frontend(0, 0, 0, 0, [], []), 0.0), at(frontend(4, 0, 0, 0, [0.8] * 4, []), 5.0)
    assert Observation.between(empty, four, 0.75, 0.05).ttft_attainment == pytest.approx(0.5)
    assert Observation.between(empty, empty, 0.75, 0.05).ttft_attainment is None  # no sample, no share


def test_a_restarted_server_counts_from_zero() -> None:
    before, after = (
        at(frontend(9, 9, 9000, 90, [0.1] * 9, []), 0.0),
        at(frontend(2, 2, 1000, 10, [0.1] * 2, []), 5.0),
    )
    o = Observation.between(before, after, 1.0, 0.05)
    assert (o.request_rate, o.prompt_tokens) == (pytest.approx(0.4), 500)  # 2 / 5 s; 1000 / 2


class Connector:
    def __init__(self, **workers: int) -> None:
        self.counts = dict(workers)
        self.calls: list[tuple[str, int]] = []

    def workers(self) -> dict[str, int]:
        return dict(self.counts)

    def scale(self, role: str, count: int) -> None:
        self.calls.append((role, count))
        self.counts[role] = count

    def close(self) -> None:
        pass


class Recorded:
    """A metrics source replaying snapshots, 10 s apart."""

    def __init__(self, *snapshots: Snapshot) -> None:
        self.snapshots = [at(s, 10.0 * i) for i, s in enumerate(snapshots)]

    def snapshot(self, model: str) -> Snapshot:
        return self.snapshots.pop(0)


class Thresholds:
    def __init__(self) -> None:
        self.values = {"max_local_prefill_length": 512, "max_prefill_queue_size": 4}

    def thresholds(self) -> dict[str, int]:
        return dict(self.values)

    def set(self, **values: int) -> None:
        self.values.update(values)


def planner(
    source: Recorded,
    connector: Connector,
    disaggregated: bool = True,
    leader: bool = True,
    correct=False,
    scale_down_intervals: int = 1,
    **kw,
) -> Planner:
    """A planner stepping every 10 s; without corrections unless asked (the sizing then is the profile's own), and
    scaling down at the first interval under the count unless told to wait longer."""
    config = PlannerConfig(MODEL, TARGETS, Bounds(1, 4, 1, 4, 8), interval_s=10.0, predictor="constant",
                           disaggregated=disaggregated, correct=correct,
                           scale_down_intervals=scale_down_intervals)  # fmt: skip
    leadership = type("Lease", (), {"is_leader": lambda self: leader, "release": lambda self: None})()
    return Planner(
        config, PROFILE, source, connector, PlannerMetrics.create(CollectorRegistry()), leadership, **kw
    )


IDLE = frontend(0, 0, 0, 0, [], [])


def test_a_burst_that_only_queues_scales_prefill_up_before_any_ttft_sample() -> None:
    # nothing finished, no first token yet: 8 requests queued with 16000 prompt tokens. Prefill load is
    # 16000 / 10 s = 1600 tok/s; the queue's mean prompt is 2000 tokens (TTFT 1.0 s = the target: capacity 0)...
    # so with 1000-token prompts instead: 8 queued x 1000 = 8000 -> 800 tok/s / 1333.3 = 0.6 -> 1 worker; use
    # 24 queued x 1000 = 24000 -> 2400 tok/s / 1333.3 = 1.8 -> 2 prefill workers.
    connector = Connector(prefill=1, decode=1)
    p = planner(Recorded(IDLE, frontend(0, 0, 0, 0, [], [], queued=24, queued_prompt=24000)), connector)
    assert p.step() is None  # the baseline
    decision = p.step()
    assert decision.observed.request_rate == 0 and decision.observed.ttft_s is None
    assert decision.counts.prefill_need == pytest.approx(1.8)
    assert connector.calls == [("prefill", 2)]


def test_requests_waiting_as_the_rate_implies_are_no_backlog() -> None:
    # 2 req/s meeting the 1 s TTFT target: 2 x 1 = 2 requests (2000 tokens) wait for a first token at any time
    # (Little's law); they are in the rate already. 5000 queued tokens leave a backlog of 3000: 300 tok/s more.
    for queued, backlog in ((2000, 0.0), (5000, 3000.0)):
        p = planner(Recorded(IDLE, frontend(20, 20, 20000, 2000, [0.6] * 20, [0.03] * 40, 2, queued)),
                    Connector(prefill=2, decode=1))  # fmt: skip
        p.step()
        decision = p.step()
        assert decision.load.queued_prompt_tokens == backlog
        assert decision.counts.prefill_need == pytest.approx((2000 + backlog / 10) / (4000 / 3))


def test_steady_load_sizes_both_roles_and_scales_down_one_at_a_time() -> None:
    # 10 s: 20 first tokens (2 req/s), 20 finished with 1000 prompt and 100 output tokens each.
    # prefill: 2 x 1000 = 2000 tok/s / 1333.3 = 1.5 -> 2; decode at context 1000 + 50: 8 streams / 0.04 s = 200
    # tok/s per worker; 2 x 100 = 200 tok/s -> 1.0 -> 1 (the 1e-9 slack keeps exactly 1.0 at 1).
    steady = frontend(20, 20, 20000, 2000, [0.6] * 20, [0.03] * 40)
    connector = Connector(prefill=4, decode=3)
    p = planner(Recorded(IDLE, steady), connector)
    p.step()
    decision = p.step()
    assert (decision.counts.prefill, decision.counts.decode) == (2, 1)
    assert decision.after == {"prefill": 3, "decode": 2}  # down by one per role per interval
    assert connector.calls == [("prefill", 3), ("decode", 2)]
    assert "need prefill 1.50, decode 1.00" in decision.describe(MODEL)


def test_corrections_scale_the_profile_by_observed_over_predicted_latency() -> None:
    # 2 req/s of 1000-token prompts on 2 prefill workers: S = 0.5 s, rho = 2 x 0.5 / 2 = 0.5, predicted TTFT
    # 0.5 + 0.5 x 0.5 / (2 x 0.5) = 0.75 s; observed 1.5 s -> sample 2.0, factor (1 + 2) / 2 = 1.5. Scaled S = 0.75:
    # rho_max = 2 (1 - 0.75) / (2 - 0.75) = 0.4, capacity 0.4 x 1000 / 0.75 = 533.3 tok/s; 2000 / 533.3 = 3.75 -> 4.
    # decode: streams = 2 x 100 x 0.03 / 1 = 6 per worker, under the smallest measured 8: profile ITL 0.04 s;
    # observed 0.03 -> sample 0.75, factor (1 + 0.75) / 2 = 0.875; 8 / (0.04 x 0.875) = 228.6 tok/s; 200 -> 0.875 -> 1.
    connector = Connector(prefill=2, decode=1)
    p = planner(
        Recorded(IDLE, frontend(20, 20, 20000, 2000, [1.5] * 20, [0.03] * 40)), connector, correct=True
    )
    p.step()
    decision = p.step()
    assert decision.correction == pytest.approx({"prefill": 1.5, "decode": 0.875})
    assert decision.counts.prefill_need == pytest.approx(3.75)
    assert decision.counts.decode_need == pytest.approx(0.875)
    assert (decision.counts.prefill, decision.counts.decode) == (4, 1)
    assert p.metrics.correction.labels(MODEL, "prefill")._value.get() == pytest.approx(1.5)


def test_the_first_step_brings_each_role_to_its_minimum() -> None:
    connector = Connector(prefill=0, decode=0)
    assert (
        planner(Recorded(IDLE), connector).step() is None
    )  # nothing observed yet, but the floor holds at once
    assert connector.calls == [("prefill", 1), ("decode", 1)]


def test_scale_down_waits_for_the_need_to_stay_low() -> None:
    # 2 req/s needs 2 prefill workers (the steady test); 4 run. Window of 3 intervals: hold, hold, then 4 -> 3; the
    # window starts over: hold, hold, 3 -> 2. A burst in between (need above the count) would reset it.
    steady = [
        frontend(20 * k, 20 * k, 20000 * k, 2000 * k, [0.6] * 20 * k, [0.03] * 40 * k) for k in range(7)
    ]
    connector = Connector(prefill=4, decode=1)
    p = planner(Recorded(*steady), connector, scale_down_intervals=3)
    p.step()
    assert [p.step().after["prefill"] for _ in range(6)] == [4, 4, 3, 3, 3, 2]
    assert connector.calls == [("prefill", 3), ("prefill", 2)]


def test_aggregated_workers() -> None:
    # one role: each request costs 1000 / 1333.3 + 100 / 200 = 0.75 + 0.5 = 1.25 worker-seconds; 2 req/s -> 2.5 -> 3
    connector = Connector(both=1)
    p = planner(Recorded(IDLE, frontend(20, 20, 20000, 2000, [0.6] * 20, [0.03] * 40)), connector, False)
    p.step()
    assert p.step().counts.decode == 3
    assert connector.calls == [("both", 3)]


def test_a_planner_without_the_lease_decides_but_does_not_act() -> None:
    connector = Connector(prefill=1, decode=1)
    p = planner(Recorded(IDLE, frontend(0, 0, 0, 0, [], [], 24, 24000)), connector, leader=False)
    p.step()
    decision = p.step()
    assert decision.counts.prefill == 2 and decision.after == {"prefill": 1, "decode": 1}
    assert connector.calls == []
    assert p.metrics.leader.labels(MODEL)._value.get() == 0


@pytest.mark.parametrize(
    "ttft, itl, length",
    [
        ([0.6] * 20, [0.03] * 40, 512),  # both targets met: the local-prefill length holds
        ([0.6] * 20, [0.03] * 30 + [0.2] * 10, 256),  # 75 % of gaps within ITL: prefill less locally (halve)
        (
            [3.0] * 20,
            [0.01] * 40,
            1024,
        ),  # TTFT missed, ITL has room: the decode workers prefill more (double)
    ],
    ids=["hold", "itl-missed", "ttft-missed"],
)
def test_thresholds_follow_attainment_and_prefill_workers(ttft, itl, length) -> None:
    thresholds = Thresholds()
    p = planner(Recorded(IDLE, frontend(20, 20, 20000, 2000, ttft, itl)), Connector(prefill=2, decode=1),
                thresholds=thresholds)  # fmt: skip
    p.step()
    decision = p.step()
    # 2 prefill workers asked for (see the steady test): 4 remote prefills in flight each
    assert thresholds.values == {"max_local_prefill_length": length, "max_prefill_queue_size": 8}
    assert decision.thresholds == thresholds.values


def test_the_frontend_registry_is_a_source() -> None:
    metrics = FrontendMetrics.create(CollectorRegistry())
    source = RegistrySource(metrics.registry)
    before = source.snapshot(MODEL)
    metrics.time_to_first_token.labels(MODEL).observe(0.2)
    metrics.queued_prompt_tokens.labels(MODEL).inc(300)
    o = Observation.between(before, source.snapshot(MODEL), 1.0, 0.05)
    assert (o.ttft_attainment, o.queued_prompt_tokens) == (1.0, 300)


RAMP = [float(v) for v in range(1, 21)]


@pytest.mark.parametrize(
    "predictor, expected",
    [
        (Constant(), 20.0),  # the last value
        (MovingAverage(window=4), 18.5),  # (17 + 18 + 19 + 20) / 4
    ],
)
def test_simple_predictors(predictor, expected) -> None:
    assert predictor.predict() == 0.0
    for value in RAMP:
        predictor.add(value)
    assert predictor.predict() == expected


def test_arima_follows_a_trend_and_auto_picks_by_measured_error() -> None:
    arima, auto = Arima(), Auto()
    for value in RAMP:
        arima.add(value)
        auto.predict()  # each candidate predicts before the value is known: that is what gets scored
        auto.add(value)
    assert arima.predict() == pytest.approx(21.0, abs=0.5)  # one more step of the ramp
    assert auto.errors["moving_average"] > auto.errors["constant"] > auto.errors["arima"]
    assert auto.best == "arima" and auto.predict() == pytest.approx(21.0, abs=0.5)
    with pytest.raises(ValueError, match="--predictor 'prophet'"):
        make_predictor("prophet")


def test_a_scrape_of_metrics_text_is_a_source() -> None:
    metrics = FrontendMetrics.create(CollectorRegistry())
    metrics.time_to_first_token.labels(MODEL).observe(0.2)
    body = generate_latest(metrics.registry)

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        snapshot = ScrapeSource(f"http://127.0.0.1:{server.server_port}/metrics").snapshot(MODEL)
    finally:
        server.shutdown()
    assert snapshot.values["strata_time_to_first_token_seconds_count"] == 1.0
    with pytest.raises(OSError):
        ScrapeSource("http://127.0.0.1:1/metrics", timeout_s=1).snapshot(MODEL)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--profile", "{missing}"], "--profile {missing}: No such file or directory"),
        (["--profile", "{bad}"], "not a worker profile"),
        (["--profile", "{good}"], "--connector local needs --model-repository and --redis-url"),
        (["--profile", "{good}", "--ttft-target", "0"], "--ttft-target must be positive, got 0.0"),
        (
            ["--profile", "{good}", "--deployment", "decode", "--connector", "kubernetes"],
            "expected ROLE=NAME",
        ),
    ],
    ids=["no-profile", "bad-profile", "local-needs-redis", "zero-target", "bad-deployment"],
)
def test_strata_planner_refuses_bad_flags_naming_them(tmp_path, args, message) -> None:
    files = {
        "missing": tmp_path / "missing.json",
        "bad": tmp_path / "bad.json",
        "good": tmp_path / "good.json",
    }
    files["bad"].write_text('{"prefill": []}')
    files["good"].write_text(
        '{"prefill": [{"prompt_tokens": 128, "ttft_s": 0.2}], '
        '"decode": [{"concurrency": 1, "context_tokens": 256, "itl_s": 0.05}]}'
    )
    args = [a.format(**files) for a in args]
    base = ["planner", "--model", "m", "--metrics-url", "http://127.0.0.1:1/metrics", "--ttft-target", "1",
            "--itl-target", "0.1", "--metrics-port", "0"]  # fmt: skip
    result = run_cli(*base, *args)
    assert result.returncode == 2
    assert message.format(**files) in result.stderr


def test_the_last_interval_sizes_a_rise_and_counts_toward_a_fall() -> None:
    """With a moving average (window 4), the rate sized for is the last interval's when that is higher: after
    three intervals at 1 req/s, one at 4 req/s is sized as 4 (the average, 1.75, lags the ramp), and decode (a
    worker carries 200 tok/s: 2 req/s of 100 tokens) goes 1 -> 2. The fall back to 1 req/s is sized as the
    average, (1 + 1 + 4 + 1) / 4 = 1.75 -> 1 worker, and each interval at 1 req/s counts toward the scale-down:
    2 -> 1 after the window of 2 intervals. `follow_last` off: the average only (1.75 at most: 1 worker)."""

    def interval(done: int) -> Snapshot:  # cumulative: `done` requests of 1000 + 100 tokens so far
        return frontend(done, done, 1000 * done, 100 * done, [0.6] * done, [0.03] * 2 * done)

    cumulative = [0, 10, 20, 30, 70, 80, 90]  # 1, 1, 1, 4, 1, 1 req/s over six 10 s intervals
    for follow, rates, decode in (
        (True, [1.0, 1.0, 1.0, 4.0, 1.75, 1.75], [1, 1, 1, 2, 2, 1]),
        (False, [1.0, 1.0, 1.0, 1.75, 1.75, 1.75], [1, 1, 1, 1, 1, 1]),
    ):
        source = Recorded(*(interval(done) for done in cumulative))
        config = PlannerConfig(MODEL, TARGETS, Bounds(1, 4, 1, 4, 8), interval_s=10.0, predictor="moving_average",
                               correct=False, follow_last=follow, scale_down_intervals=2)  # fmt: skip
        connector = Connector(prefill=1, decode=1)
        p = Planner(config, PROFILE, source, connector, PlannerMetrics.create(CollectorRegistry()))
        assert p.step() is None
        decisions = [p.step() for _ in range(6)]
        assert [d.load.request_rate for d in decisions] == pytest.approx(rates)
        assert [d.after["decode"] for d in decisions] == decode
