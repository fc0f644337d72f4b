"""`strata serve`: start Triton, bring the repositories in, serve until SIGTERM/SIGINT, then shut down cleanly.

The wiring lives here: the LLM deployment (server.deployment) runs the engines, the backend registry
(server.backends.registry) is handed to the repository manager, and the OpenAI frontend serves the same engines.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from prometheus_client import CollectorRegistry

from server import backends
from server.backends.llm import LLMBackend
from server.backends.unavailable import StartupHold
from server.cli import cluster_secret, engine_overrides, kvbm_config, request_limits, triton_access
from server.deployment import LLMDeployment, LLMServing
from server.frontend import OpenAIFrontend
from server.planner.embedded import EmbeddedPlanner
from server.repository.manager import ControlMode, RepositoryManager
from server.router.config import RouterConfig
from server.router.disagg import DisaggConfig
from server.triton import PortInUse, TritonServer, TritonSettings, check_ports_free

log = logging.getLogger("strata")

_WATCHDOG_SECS = 1.0  # how often the main thread checks that Triton is still alive


def serve(args: argparse.Namespace) -> int:
    for repository in args.model_repository:
        if not repository.is_dir():
            log.error("--model-repository %s: not a folder", repository)
            return 2
    try:
        serving = llm_serving(args)
        limits = request_limits(args)
        triton_settings = TritonSettings(
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            metrics_port=args.metrics_port,
            address=args.http_address,
            strict_readiness=args.strict_readiness,
            exit_timeout_secs=args.exit_timeout_secs,
            log_verbose=args.log_verbose,
            **triton_access(args),
        )
        triton_settings.control_token()  # a restriction that would lock Strata out of its own Triton fails here
    except ValueError as exc:  # KVBMConfigError, RouterConfig, access flags: the message names the setting
        log.error("%s", exc)
        return 2
    try:
        if args.allow_openai:
            check_ports_free(args.http_address, {"--openai-port": args.openai_port})
        triton = TritonServer(triton_settings)
    except PortInUse as exc:
        log.error("%s", exc)
        return 2
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopping.set())
    registry = CollectorRegistry()
    deployment = LLMDeployment(serving, registry)
    manager = RepositoryManager(
        [r.resolve() for r in args.model_repository],
        backends.registry(triton, LLMBackend(triton, deployment)),
        ControlMode(args.model_control_mode),
        args.repository_poll_secs,
        args.load_model,
    )
    frontend, planner = None, None
    if args.allow_openai:
        frontend = OpenAIFrontend(
            deployment.engines,
            args.http_address,
            args.openai_port,
            registry,
            api_key=args.api_key,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            limits=limits,
        )
    try:
        # staged before Triton starts, so that Triton loads it (and is not ready) from its first moment
        hold = StartupHold(triton) if args.strict_readiness else None
        triton.start()
        if frontend is not None:
            frontend.start()
        manager.start()
        if args.planner is not None:
            planner = EmbeddedPlanner.start(args, deployment.engines, registry)
        if hold is not None:
            hold.release()
        log.info("strata ready (pid %d)", os.getpid())
        while not stopping.wait(_WATCHDOG_SECS):
            if not triton.is_alive():
                log.error("Triton exited unexpectedly; shutting down")
                return 1
        log.info("signal received, shutting down (exit timeout %d s)", args.exit_timeout_secs)
        return 0
    except ValueError as exc:  # --planner: a model not served, a bad profile (the message names it)
        log.error("%s", exc)
        return 2
    finally:
        if planner is not None:
            planner.stop()
        _shutdown(manager, frontend, deployment, triton, args.exit_timeout_secs)
        if planner is not None:
            planner.stop_workers()  # after the model's engine let them go: they exit at once


def llm_serving(args: argparse.Namespace) -> LLMServing:
    """The LLM deployment the flags describe; ValueError names a bad flag."""
    router = RouterConfig(
        strategy=args.routing_strategy,
        fallback=args.router_fallback,
        temperature=args.router_temperature,
        overlap_weight=args.router_overlap_weight,
        busy_threshold=args.router_busy_threshold,
        count_in_flight=args.router_count_in_flight,
        migration_limit=args.migration_limit,
    )
    if args.accept_remote_workers and not args.redis_url:
        raise ValueError("--accept-remote-workers: needs --redis-url (remote workers register in Redis)")
    if args.workers is not None and args.workers < 0:
        raise ValueError(f"--workers: must be >= 0, got {args.workers}")
    if args.planner is not None and not args.accept_remote_workers:
        raise ValueError("--planner: its workers join through Redis; needs --accept-remote-workers")
    if args.workers == 0 and not args.accept_remote_workers:
        raise ValueError("--workers 0: serves LLMs by remote workers only; needs --accept-remote-workers")
    if args.kvbm and args.kvbm_flush_secs > args.exit_timeout_secs:
        raise ValueError(
            f"--kvbm-flush-secs {args.kvbm_flush_secs:g}: the G2 -> G3 copy at stop must fit in "
            f"--exit-timeout-secs {args.exit_timeout_secs}"
        )
    for flag, value in (
        ("--prefill-workers", args.prefill_workers),
        ("--decode-workers", args.decode_workers),
    ):
        if value is not None and value < 0:
            raise ValueError(f"{flag}: must be >= 0, got {value}")
    if (args.prefill_workers is not None or args.decode_workers is not None) and args.workers is not None:
        raise ValueError("--workers: give either --workers or --prefill-workers/--decode-workers")
    try:
        disagg = DisaggConfig(args.max_local_prefill_length, args.max_prefill_queue_size)
    except ValueError as exc:
        raise ValueError(f"--max-local-prefill-length/--max-prefill-queue-size: {exc}") from None
    secret = cluster_secret(args, secret_needed_by(args))  # read once: links and G4 keys derive from it
    return LLMServing(
        router,
        args.workers,
        kvbm_config(args, secret),
        args.kvbm_service,
        engine_overrides(args),
        remote_workers=args.redis_url if args.accept_remote_workers else None,
        cluster_secret=secret,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        disagg=disagg,
        vllm_python=args.vllm_python,
    )


def secret_needed_by(args: argparse.Namespace) -> str | None:
    """The flag of `strata serve` that needs the cluster secret, if any (named when it is missing)."""
    if args.accept_remote_workers:
        return "--accept-remote-workers"
    if args.kvbm_service:
        return "--kvbm-service"
    if args.redis_url and args.kvbm:
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
