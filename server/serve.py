"""`strata serve`: start Triton, bring the repositories in, serve until SIGTERM/SIGINT, then shut down cleanly.

The wiring lives here: the LLM deployment (server.deployment) runs the engines, the backend registry
(server.backends.registry) is handed to the repository manager, and the OpenAI frontend serves the same engines.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from prometheus_client import CollectorRegistry

from server import backends, tracing
from server.backends.llm import LLMBackend
from server.backends.unavailable import StartupHold
from server.cli import (
    cluster_secret,
    engine_overrides,
    kvbm_config,
    request_limits,
    response_store,
    triton_access,
)
from server.deployment import LLMDeployment, LLMServing
from server.embeddings import EmbeddingModels
from server.frontend import OpenAIFrontend
from server.logs import LogSettings
from server.openai.observe import CORSSettings
from server.options import ServeOptions
from server.planner.embedded import EmbeddedPlanner
from server.repository.manager import ControlMode, RepositoryManager
from server.router.config import RouterConfig
from server.router.disagg import DisaggConfig
from server.tracing import TracingSettings
from server.triton import PortInUse, TritonServer, TritonSettings, check_ports_free

log = logging.getLogger("strata")

_WATCHDOG_SECS = 1.0  # how often the main thread checks that Triton is still alive


def serve(options: ServeOptions) -> int:
    for repository in options.model_repository:
        if not repository.is_dir():
            log.error("--model-repository %s: not a folder", repository)
            return 2
    if options.enable_auto_tool_choice and options.tool_call_parser is None:
        log.error("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
        return 2
    try:
        serving = llm_serving(options)
        limits = request_limits(options)
        responses = response_store(options)
        cors = cors_settings(options)
        triton_settings = TritonSettings(
            http_port=options.http_port,
            grpc_port=options.grpc_port,
            metrics_port=options.metrics_port,
            address=options.http_address,
            strict_readiness=options.strict_readiness,
            exit_timeout_secs=options.exit_timeout_secs,
            log_verbose=options.log_verbose,
            auto_complete=not (options.disable_auto_complete_config or options.strict_model_config),
            cache_config=options.cache_config,
            rate_limit=options.rate_limit,
            rate_limit_resource=options.rate_limit_resource,
            trace_config=triton_trace_config(options),
            **triton_access(options),
        )
        triton_settings.control_token()  # a restriction that would lock Strata out of its own Triton fails here
    except ValueError as exc:  # KVBMConfigError, RouterConfig, access flags: the message names the setting
        log.error("%s", exc)
        return 2
    try:
        if options.allow_openai:
            check_ports_free(options.http_address, {"--openai-port": options.openai_port})
        registry = CollectorRegistry()  # Strata's series, on the metrics port and the OpenAI port's /metrics
        triton = TritonServer(triton_settings, registry)
    except PortInUse as exc:
        log.error("%s", exc)
        return 2
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopping.set())
    deployment = LLMDeployment(serving, registry)
    embedders = EmbeddingModels(triton.inference_client, triton.inference_headers)
    manager = RepositoryManager(
        [r.resolve() for r in options.model_repository],
        embedders.watch(backends.registry(triton, LLMBackend(triton, deployment))),
        ControlMode(options.model_control_mode),
        options.repository_poll_secs,
        options.load_model,
        auto_complete=triton_settings.auto_complete,
    )
    frontend, planner = None, None
    if options.allow_openai:
        frontend = OpenAIFrontend(
            deployment.served,
            options.http_address,
            options.openai_port,
            registry,
            api_key=options.api_key,
            ssl_keyfile=options.ssl_keyfile,
            ssl_certfile=options.ssl_certfile,
            limits=limits,
            response_store=responses,
            embedders=embedders,
            tool_call_parser=options.tool_call_parser if options.enable_auto_tool_choice else None,
            access_log=not options.disable_uvicorn_access_log,
            cors=cors,
        )
    tracing.configure_from(serving.tracing, "server")
    try:
        # staged before Triton starts, so that Triton loads it (and is not ready) from its first moment
        hold = StartupHold(triton) if options.strict_readiness else None
        triton.start()
        if frontend is not None:
            frontend.start()
        manager.start()
        if options.planner is not None:
            planner = EmbeddedPlanner.start(options, deployment.engines, registry)
        if hold is not None:
            hold.release()
        if not triton.is_alive():  # it died while the repository loaded (its log says why)
            log.error("Triton exited while the repository loaded; shutting down")
            return 1
        log.info("strata ready (pid %d)", os.getpid())
        while not stopping.wait(_WATCHDOG_SECS):
            if not triton.is_alive():
                log.error("Triton exited unexpectedly; shutting down")
                return 1
        log.info("signal received, shutting down (exit timeout %d s)", options.exit_timeout_secs)
        return 0
    except ValueError as exc:  # --planner: a model not served, a bad profile (the message names it)
        log.error("%s", exc)
        return 2
    finally:
        if planner is not None:
            planner.stop()
        _shutdown(manager, frontend, deployment, triton, options.exit_timeout_secs)
        if planner is not None:
            planner.stop_workers()  # after the model's engine let them go: they exit at once
        tracing.shutdown()  # export the spans still buffered


def llm_serving(options: ServeOptions) -> LLMServing:
    """The LLM deployment the flags describe; ValueError names a bad flag."""
    router = RouterConfig(
        strategy=options.routing_strategy,
        fallback=options.router_fallback,
        temperature=options.router_temperature,
        overlap_weight=options.router_overlap_weight,
        busy_threshold=options.router_busy_threshold,
        count_in_flight=options.router_count_in_flight,
        migration_limit=options.migration_limit,
    )
    if options.accept_remote_workers and not options.redis_url:
        raise ValueError("--accept-remote-workers: needs --redis-url (remote workers register in Redis)")
    if options.workers is not None and options.workers < 0:
        raise ValueError(f"--workers: must be >= 0, got {options.workers}")
    if options.planner is not None and not options.accept_remote_workers:
        raise ValueError("--planner: its workers join through Redis; needs --accept-remote-workers")
    if options.workers == 0 and not options.accept_remote_workers:
        raise ValueError("--workers 0: serves LLMs by remote workers only; needs --accept-remote-workers")
    if options.tiers.kvbm and options.tiers.kvbm_flush_secs > options.exit_timeout_secs:
        raise ValueError(
            f"--kvbm-flush-secs {options.tiers.kvbm_flush_secs:g}: the G2 -> G3 copy at stop must fit in "
            f"--exit-timeout-secs {options.exit_timeout_secs}"
        )
    for flag, value in (
        ("--prefill-workers", options.prefill_workers),
        ("--decode-workers", options.decode_workers),
    ):
        if value is not None and value < 0:
            raise ValueError(f"{flag}: must be >= 0, got {value}")
    if (
        options.prefill_workers is not None or options.decode_workers is not None
    ) and options.workers is not None:
        raise ValueError("--workers: give either --workers or --prefill-workers/--decode-workers")
    try:
        disagg = DisaggConfig(options.max_local_prefill_length, options.max_prefill_queue_size)
    except ValueError as exc:
        raise ValueError(f"--max-local-prefill-length/--max-prefill-queue-size: {exc}") from None
    secret = cluster_secret(options, secret_needed_by(options))  # read once: links and G4 keys derive from it
    return LLMServing(
        router,
        options.workers,
        kvbm_config(options, secret),
        options.kvbm_service,
        engine_overrides(options.engine),
        remote_workers=options.redis_url if options.accept_remote_workers else None,
        cluster_secret=secret,
        prefill_workers=options.prefill_workers,
        decode_workers=options.decode_workers,
        disagg=disagg,
        vllm_python=options.vllm_python,
        logs=LogSettings(options.log_file, options.log_format),
        tracing=TracingSettings(options.otlp_traces_endpoint, options.otlp_traces_sample_ratio),
    )


def triton_trace_config(options: ServeOptions) -> tuple[str, ...]:
    """Triton's --trace-config: the operator's, else with --otlp-traces-endpoint Triton's OpenTelemetry mode to the
    same collector at the same ratio (Triton traces one request in `rate`)."""
    if options.trace_config or options.otlp_traces_endpoint is None:
        return options.trace_config
    ratio = options.otlp_traces_sample_ratio
    if ratio <= 0:
        return ()
    url = tracing.traces_url(options.otlp_traces_endpoint)
    return (
        "mode=opentelemetry",
        f"opentelemetry,url={url}",
        f"rate={max(1, round(1 / ratio))}",
        "level=TIMESTAMPS",
    )


def cors_settings(options: ServeOptions) -> CORSSettings | None:
    if options.allowed_origins is None:
        return None
    return CORSSettings(
        tuple(options.allowed_origins),
        tuple(options.allowed_methods),
        tuple(options.allowed_headers),
        options.allow_credentials,
        options.cors_admin_routes,
    )


def secret_needed_by(options: ServeOptions) -> str | None:
    """The flag of `strata serve` that needs the cluster secret, if any (named when it is missing)."""
    if options.accept_remote_workers:
        return "--accept-remote-workers"
    if options.kvbm_service:
        return "--kvbm-service"
    if options.redis_url and options.tiers.kvbm:
        return "--redis-url (G4 blocks are signed)"
    return None


def _shutdown(
    manager: RepositoryManager,
    frontend: OpenAIFrontend | None,
    deployment: LLMDeployment,
    triton: TritonServer,
    exit_timeout_secs: int,
) -> None:
    """Stop within the exit timeout: a timer ends the process if a part hangs."""
    deadline = threading.Timer(exit_timeout_secs + 5, _force_exit)
    deadline.daemon = True
    deadline.start()
    if frontend is not None:
        frontend.stop()
    manager.stop()
    deployment.close()
    triton.stop()
    deadline.cancel()
    log.info("stopped")


def _force_exit() -> None:
    log.error("shutdown exceeded the exit timeout; exiting now")
    os._exit(1)
