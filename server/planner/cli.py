"""`strata planner` and `strata profile`: their flags and how they start (server/cli.py adds the subcommands)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import socket
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

from server import settings
from server.options import PlannerOptions, ProfileOptions, SLAFlags
from server.planner.predict import PREDICTORS

log = logging.getLogger(__name__)


def add_planner_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "planner",
        help="scale a model's prefill and decode (or aggregated) workers to meet TTFT and ITL targets",
    )
    p.add_argument("--model", required=True, help="the LLM model to plan for")
    p.add_argument("--metrics-url", required=True, help="the Strata frontend's /metrics (OpenAI port)")
    p.add_argument(
        "--profile", type=Path, required=True, help="the worker profile (`strata profile --output`)"
    )
    sla_flags(p)
    p.add_argument(
        "--aggregated",
        action="store_true",
        help="plan aggregated workers (role both) instead of prefill + decode",
    )
    p.add_argument(
        "--connector",
        choices=["local", "kubernetes"],
        default="local",
        help="how workers are added and removed: local (`strata worker` processes on this host, below) or "
        "kubernetes (the scale of one Deployment per role, below)",
    )
    p.add_argument("--dry-run", action="store_true", help="log what it would scale, change nothing")
    p.add_argument("--metrics-port", type=int, default=9100, help="the planner's own /metrics (0: none)")
    p.add_argument(
        "--disagg-url",
        default=None,
        help="the frontend's OpenAI base URL: tune the conditional-disaggregation thresholds there "
        "(PUT /v1/strata/models/{model}/disagg, with --api-key)",
    )
    p.add_argument(
        "--api-key", default=settings.api_key(), help="the frontend's --api-key (default: $STRATA_API_KEY)"
    )
    local = p.add_argument_group("local connector (strata worker processes on this host)")
    local.add_argument(
        "--model-repository", type=Path, default=None, help="repository folder the started workers serve from"
    )
    local.add_argument(
        "--redis-url", default=None, help="the server's --redis-url; also holds the planner lease"
    )
    local.add_argument(
        "--worker-args", default="", help="more `strata worker` flags, one shell-quoted string"
    )
    local.add_argument(
        "--exit-timeout-secs", type=int, default=30, help="each worker's drain time on scale-down"
    )
    k8s = p.add_argument_group("Kubernetes connector")
    k8s.add_argument("--namespace", default=None, help="default: the planner pod's namespace")
    k8s.add_argument(
        "--deployment", action="append", default=[], metavar="ROLE=NAME", help="the Deployment of each role"
    )
    k8s.add_argument("--lease-name", default=None, help="default: strata-planner-<model>")
    k8s.add_argument(
        "--identity", default=None, help="lease holder name (default: $POD_NAME, else the host name)"
    )


def add_embedded_planner_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--planner",
        default=None,
        metavar="MODEL",
        help="scale MODEL's workers to the SLA targets: `strata worker` processes on this host, joining through "
        "--redis-url (needs --accept-remote-workers)",
    )
    group.add_argument(
        "--planner-profile", type=Path, default=None, help="the worker profile (`strata profile`)"
    )
    group.add_argument(
        "--planner-worker-args", default="", help="more `strata worker` flags, one quoted string"
    )
    sla_flags(group)


def sla_flags(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The targets, interval, predictor and bounds (shared by `strata planner` and `strata serve --planner`)."""
    group.add_argument("--ttft-target", type=float, default=None, help="time to first token target, seconds")
    group.add_argument("--itl-target", type=float, default=None, help="inter-token latency target, seconds")
    group.add_argument("--adjustment-interval", type=float, default=30.0, help="seconds between decisions")
    group.add_argument(
        "--predictor",
        choices=PREDICTORS,
        default="moving_average",
        help="load predictor (default: moving_average, chosen by bench/predictors.py; auto refits ARIMA each "
        "interval, ~80 ms of CPU per series)",
    )
    group.add_argument("--min-workers", type=int, default=1, help="per role")
    group.add_argument("--max-workers", type=int, default=8, help="per role")
    group.add_argument("--max-total-workers", type=int, default=16, help="all roles together")
    group.add_argument(
        "--no-follow-last",
        dest="follow_last",
        action="store_false",
        help="the predictor's rate only (default: size for the last interval's rate when higher, and count an "
        "interval toward a scale-down on it when lower)",
    )
    group.add_argument(
        "--scale-down-intervals",
        type=int,
        default=3,
        help="intervals in a row the need must stay under a role's count before one of its workers is drained",
    )


def add_profile_parser(
    sub: argparse._SubParsersAction, engine_flags: Callable[[argparse._ArgumentGroup], None]
) -> None:
    p = sub.add_parser("profile", help="measure one worker of a model on this hardware, for the planner")
    p.add_argument("--model-repository", type=Path, required=True, help="repository folder holding the model")
    p.add_argument("--model", required=True, help="the LLM model (folder name) to profile")
    p.add_argument("--output", type=Path, required=True, help="the profile file the planner reads (JSON)")
    p.add_argument(
        "--prompt-lengths", type=_ints, default=(128, 512, 1024, 2048), help="comma-separated tokens"
    )
    p.add_argument("--concurrency", type=_ints, default=(1, 4, 8, 16), help="comma-separated stream counts")
    p.add_argument("--contexts", type=_ints, default=(256, 1024), help="comma-separated context tokens")
    p.add_argument("--decode-tokens", type=int, default=24, help="tokens each stream decodes per ITL point")
    p.add_argument("--repeats", type=int, default=3, help="TTFT samples per prompt length (median)")
    engine_flags(p.add_argument_group("engine overrides (as `strata worker` takes them)"))


def run_profile(options: ProfileOptions, overrides: dict[str, int]) -> int:
    from server.engine.llm_engine import LLMEngine
    from server.planner.profile import profile_worker, save, table
    from server.workers.remote_worker import model_engine_config

    try:
        config = model_engine_config(options.model_repository, options.model, overrides)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    engine = LLMEngine(config)
    try:
        profile = profile_worker(
            engine,
            options.prompt_lengths,
            options.concurrency,
            options.contexts,
            options.decode_tokens,
            options.repeats,
        )
    finally:
        engine.close()
    save(profile, options.output)
    print(table(profile))
    print(f"written to {options.output}")
    return 0


def run_planner(options: PlannerOptions) -> int:
    """`strata planner` until SIGTERM/SIGINT. Exit code 2 for a bad flag or profile (the message names it)."""
    from prometheus_client import CollectorRegistry, start_http_server

    from server.planner.metrics import PlannerMetrics
    from server.planner.observe import ScrapeSource
    from server.planner.planner import Planner

    registry = CollectorRegistry()
    try:
        config, profile = planner_config(options.sla, options.model, options.profile, not options.aggregated)
        connector, leadership = _connector(options)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    thresholds = (
        HttpThresholds(options.disagg_url, options.model, options.api_key) if options.disagg_url else None
    )
    planner = Planner(config, profile, ScrapeSource(options.metrics_url), connector,
                      PlannerMetrics.create(registry), leadership, thresholds)  # fmt: skip
    if options.metrics_port:
        start_http_server(options.metrics_port, registry=registry)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    planner.run(stop)
    connector.close()
    return 0


def planner_config(sla: SLAFlags, model: str, profile: Path | None, disaggregated: bool):
    """The PlannerConfig and WorkerProfile of the SLA flags (`strata planner`, `strata serve --planner`);
    ValueError names a missing or bad flag."""
    from server.planner.planner import PlannerConfig
    from server.planner.profile import load
    from server.planner.sizing import Bounds, Targets

    for flag in ("ttft_target", "itl_target", "adjustment_interval"):
        if getattr(sla, flag) is None:
            raise ValueError(f"the planner needs --{flag.replace('_', '-')}")
        if getattr(sla, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(sla, flag)}")
    if sla.scale_down_intervals < 1:
        raise ValueError(f"--scale-down-intervals must be 1 or more, got {sla.scale_down_intervals}")
    if not 0 <= sla.min_workers <= sla.max_workers <= sla.max_total_workers:
        raise ValueError("expected 0 <= --min-workers <= --max-workers <= --max-total-workers")
    bounds = Bounds(sla.min_workers, sla.max_workers, max(sla.min_workers, 1), sla.max_workers,
                    sla.max_total_workers)  # fmt: skip
    config = PlannerConfig(model, Targets(sla.ttft_target, sla.itl_target), bounds, sla.adjustment_interval,
                           sla.predictor, disaggregated, scale_down_intervals=sla.scale_down_intervals,
                           follow_last=sla.follow_last)  # fmt: skip
    if profile is None:
        raise ValueError(
            "the planner needs a worker profile (--planner-profile; write one with `strata profile`)"
        )
    return config, load(profile)


def _connector(options: PlannerOptions):
    if options.connector == "kubernetes":
        from server.planner.kubernetes import KubernetesConnector, KubernetesLeadership

        deployments = dict(_role_name(value) for value in options.deployment)
        connector = KubernetesConnector.from_cluster(options.namespace, deployments, options.dry_run)
        identity = options.identity or os.environ.get("POD_NAME") or socket.gethostname()
        leadership = KubernetesLeadership.from_cluster(
            options.namespace, options.lease_name or f"strata-planner-{options.model}", identity
        )
        return connector, leadership
    from server.planner.local import LocalConnector, RedisLeadership

    if options.model_repository is None or options.redis_url is None:
        raise ValueError("--connector local needs --model-repository and --redis-url")
    connector = LocalConnector(options.model_repository, options.model, options.redis_url,
                               shlex.split(options.worker_args), exit_timeout_s=options.exit_timeout_secs)  # fmt: skip
    if options.dry_run:
        raise ValueError(
            "--dry-run is for --connector kubernetes; the local connector acts or is not started"
        )
    lease_s = 3 * options.sla.adjustment_interval
    return connector, RedisLeadership(options.redis_url, options.model, lease_s=lease_s)


class HttpThresholds:
    """The DisaggControl of a model served by a frontend elsewhere: GET and PUT /v1/strata/models/{model}/disagg."""

    def __init__(self, base_url: str, model: str, api_key: str | None) -> None:
        self.url = f"{base_url.rstrip('/')}/v1/strata/models/{model}/disagg"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def thresholds(self) -> dict[str, int]:
        return self._call("GET", None)

    def set(
        self, max_local_prefill_length: int | None = None, max_prefill_queue_size: int | None = None
    ) -> None:
        body = {
            "max_local_prefill_length": max_local_prefill_length,
            "max_prefill_queue_size": max_prefill_queue_size,
        }
        self._call("PUT", {k: v for k, v in body.items() if v is not None})

    def _call(self, method: str, body: dict | None) -> dict[str, int]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url, data, self.headers, method=method)
        with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 (the operator's URL)
            return json.loads(response.read())


def _role_name(value: str) -> tuple[str, str]:
    role, _, name = value.partition("=")
    if not role or not name:
        raise ValueError(f"--deployment {value!r}: expected ROLE=NAME, e.g. decode=strata-decode")
    return role, name


def _ints(value: str) -> tuple[int, ...]:
    try:
        numbers = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected comma-separated whole numbers") from None
    if not numbers or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected positive numbers")
    return numbers
