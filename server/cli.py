"""`strata` command line. Flag names follow `tritonserver` where one exists."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server import settings
from server.logs import LogSettings, configure_logging
from server.options import (
    EngineFlags,
    PlannerOptions,
    ProfileOptions,
    ServeOptions,
    WorkerOptions,
    from_flags,
)
from server.planner.cli import (
    add_embedded_planner_flags,
    add_planner_parser,
    add_profile_parser,
    run_planner,
    run_profile,
)

if TYPE_CHECKING:
    from kvbm.cli import ServiceOptions
    from kvbm.config import KVBMConfig
    from server.openai.limits import RequestLimits
    from server.openai.response_store import ResponseStore

    Options = ServeOptions | WorkerOptions | PlannerOptions | ProfileOptions | ServiceOptions


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model repository over KServe v2 HTTP/gRPC (Triton)")
    p.add_argument(
        "--model-repository",
        action="append",
        type=Path,
        required=True,
        help="repository folder; repeat for several",
    )
    p.add_argument(
        "--model-control-mode",
        choices=["none", "poll", "explicit"],
        default="none",
        help="tritonserver's flag: none loads every model of the repositories at start and changes nothing after; "
        "poll rescans them every --repository-poll-secs and loads, reloads or unloads what changed; explicit loads "
        "only the --load-model models at start, the rest through the repository API (default: none)",
    )
    p.add_argument(
        "--repository-poll-secs",
        type=float,
        default=15.0,
        help="poll mode: seconds between scans (a change is applied once two scans agree)",
    )
    p.add_argument(
        "--load-model",
        action="append",
        default=[],
        help="explicit mode: model to load at start; repeat; '*' loads all",
    )
    p.add_argument(
        "--http-address",
        default="0.0.0.0",
        help="tritonserver's flag: the address the HTTP server binds to (default 0.0.0.0); Strata binds the gRPC, "
        "metrics and OpenAI ports to it too",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="tritonserver's flag: the KServe v2 HTTP port (default 8000)",
    )
    p.add_argument(
        "--grpc-port",
        type=int,
        default=8001,
        help="tritonserver's flag: the KServe v2 gRPC port (default 8001)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=8002,
        help="tritonserver's flag: the port reporting Prometheus metrics, Triton's nv_* series then Strata's "
        "(default 8002; docs/metrics.md)",
    )
    p.add_argument(
        "--strict-readiness",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="as tritonserver: /v2/health/ready only once the repository's models are loaded and while every "
        "model is ready (a model that failed to load keeps the server not ready); --no-strict-readiness: ready "
        "as soon as the server is up",
    )
    p.add_argument(
        "--exit-timeout-secs",
        type=int,
        default=30,
        help="tritonserver's flag: on SIGTERM or SIGINT, seconds in-flight requests get to finish; after it the "
        "server exits even if some are still in flight (default 30)",
    )
    p.add_argument(
        "--log-verbose", type=int, default=0, help="Triton verbose log level; >0 also logs Strata at DEBUG"
    )
    _core_flags(p.add_argument_group("Triton's core for file models (ONNX, Python, TorchScript, ensembles)"))
    p.add_argument("--openai-port", type=int, default=9000, help="OpenAI-compatible API (FastAPI)")
    p.add_argument(
        "--allow-openai",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the OpenAI-compatible API on --openai-port (--no-allow-openai: Triton's ports only)",
    )
    _request_limit_flags(p.add_argument_group("OpenAI request limits (checked before a prompt is tokenized)"))
    llm = p.add_argument_group("LLM serving (models with backend strata_llm or vllm)")
    llm.add_argument(
        "--vllm-python",
        default=settings.vllm_python(),
        help="the Python of a venv with vLLM (make vllm builds .venv-vllm): models with backend vllm run in "
        "worker processes started with it (default: STRATA_VLLM_PYTHON)",
    )
    llm.add_argument(
        "--workers",
        type=int,
        default=None,
        help="engine worker processes per LLM model (default: the model's instance_group count, else 1 "
        "in-process engine; 0 with --accept-remote-workers: remote workers only)",
    )
    llm.add_argument(
        "--routing-strategy",
        choices=["kv-aware", "round-robin", "random", "least-loaded"],
        default="kv-aware",
        help="how a request picks one of its model's workers: kv-aware (the lowest cost of the prefix left to "
        "prefill plus load, docs/routing.md), round-robin, random, or least-loaded (fewest KV blocks in use per "
        "unit of decode speed)",
    )
    llm.add_argument(
        "--router-fallback",
        choices=["round-robin", "random", "least-loaded"],
        default="least-loaded",
        help="strategy used when the KV index does not answer in time",
    )
    llm.add_argument(
        "--router-temperature",
        type=float,
        default=0.0,
        help="0: pick the cheapest worker; >0: sample by softmax of -cost",
    )
    llm.add_argument(
        "--router-overlap-weight",
        type=float,
        default=1.0,
        help="kv-aware cost = this x blocks still to prefill + active blocks: how much a cached prefix outweighs "
        "load (1.0 is Dynamo's, for GPUs; CPU workers, whose prefill is dear, gain from more: docs/routing.md)",
    )
    llm.add_argument(
        "--router-busy-threshold",
        type=float,
        default=0.95,
        help="skip a worker whose reported KV in use (running requests) is at or above this "
        "fraction of its pool, unless all are; requests queued there count in the cost",
    )
    llm.add_argument(
        "--router-count-in-flight",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="count the blocks of a worker's unfinished requests as cached there (a follow-up "
        "arriving during its prefix's prefill goes to that worker)",
    )
    llm.add_argument(
        "--migration-limit",
        type=int,
        default=3,
        help="times a request is resumed on another worker when its worker dies mid-request (0: never)",
    )
    llm.add_argument(
        "--prefill-workers",
        type=int,
        default=None,
        help="disaggregated serving: prefill worker processes per LLM model (with --decode-workers; default: the "
        "model's config.pbtxt parameters prefill_workers/decode_workers, else aggregated workers)",
    )
    llm.add_argument(
        "--decode-workers",
        type=int,
        default=None,
        help="disaggregated serving: decode worker processes per LLM model",
    )
    llm.add_argument(
        "--max-local-prefill-length",
        type=int,
        default=512,
        help="disaggregated: a prompt whose part not cached on its decode worker is longer than this (tokens) is "
        "prefilled on a prefill worker; shorter ones on the decode worker",
    )
    llm.add_argument(
        "--max-prefill-queue-size",
        type=int,
        default=4,
        help="disaggregated: remote prefills in flight per model past which decode workers prefill locally",
    )
    llm.add_argument(
        "--accept-remote-workers",
        action="store_true",
        help="let `strata worker` processes on any host join each LLM model through Redis "
        "(needs --redis-url)",
    )
    _engine_flags(llm)
    kv = p.add_argument_group("KV Block Manager (tiers below the engine's own pool)")
    _kvbm_flags(kv)
    _cluster_flag(kv)
    add_embedded_planner_flags(p.add_argument_group("SLA planner (strata serve --planner MODEL)"))
    kv.add_argument(
        "--redis-url",
        default=None,
        help="G4 tier; with --kvbm-service, workers publish block events and leases there; with "
        "--accept-remote-workers, remote workers register there",
    )
    kv.add_argument(
        "--kvbm-service",
        default=None,
        metavar="HOST:PORT",
        help="query a standalone `strata kvbm` service instead of the embedded index (needs --redis-url)",
    )
    _security_flags(p.add_argument_group("access control and TLS (docs/SECURITY.md)"))
    observability = p.add_argument_group("logs, tracing and browsers (docs/observability.md)")
    _log_flags(observability)
    _trace_flags(observability)
    observability.add_argument(
        "--trace-config",
        action="append",
        default=[],
        metavar="[MODE,]SETTING=VALUE",
        help="tritonserver's flag, passed through to Triton (its own tracing of file models), e.g. "
        "mode=opentelemetry and opentelemetry,url=http://collector:4318/v1/traces; repeat. Without it, "
        "--otlp-traces-endpoint traces Triton's requests too",
    )
    observability.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="vLLM's flag: no access log line per request on the OpenAI port",
    )
    observability.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=None,
        metavar="JSON",
        help="OpenAI port: the browser origins CORS admits, a JSON list such as '[\"https://app.example\"]' "
        "(vLLM's flag; default: none, no CORS headers)",
    )
    observability.add_argument(
        "--allowed-methods", type=_json_list, default=["*"], metavar="JSON", help="with --allowed-origins"
    )
    observability.add_argument(
        "--allowed-headers", type=_json_list, default=["*"], metavar="JSON", help="with --allowed-origins"
    )
    observability.add_argument(
        "--allow-credentials", action="store_true", help="with --allowed-origins: allow cookies and auth"
    )
    observability.add_argument(
        "--cors-admin-routes",
        action="store_true",
        help="with --allowed-origins: admit those origins to the admin routes (/v1/strata/...) too; without "
        "it a browser's preflight there gets 403",
    )


def _core_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--disable-auto-complete-config",
        action="store_true",
        help="tritonserver's flag: no auto-complete; every model needs a config.pbtxt declaring its inputs and "
        "outputs (default: a model with no config.pbtxt, or a partial one, is completed from its model file)",
    )
    group.add_argument(
        "--strict-model-config",
        type=_bool_flag,
        nargs="?",
        const=True,
        default=False,
        help="tritonserver's legacy flag: true is --disable-auto-complete-config",
    )
    group.add_argument(
        "--cache-config",
        action="append",
        default=[],
        help="tritonserver's flag: <cache>,<setting>=<value>, e.g. local,size=1048576 for the response cache that "
        "models with response_cache { enable: true } use; repeat for several settings",
    )
    group.add_argument(
        "--rate-limit",
        choices=["off", "execution_count"],
        default="off",
        help="tritonserver's flag: execution_count schedules model instances by the resources and priority "
        "their instance_group rate_limiter declares (default off)",
    )
    group.add_argument(
        "--rate-limit-resource",
        action="append",
        default=[],
        help="tritonserver's flag: <name>:<count>[:<device>], a resource's count for --rate-limit; repeat",
    )


def _bool_flag(text: str) -> bool:
    """tritonserver's boolean values."""
    lowered = text.lower()
    if lowered in ("true", "on", "1"):
        return True
    if lowered in ("false", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {text!r}")


def _request_limit_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="largest HTTP body on the OpenAI port, in bytes; a larger one gets 413 unread (default 16 MiB)",
    )
    group.add_argument(
        "--max-n", type=int, default=128, help="most choices (`n`) per prompt (default 128, OpenAI's limit)"
    )
    group.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=256,
        help="most prompts in one /v1/completions request (default 256)",
    )
    group.add_argument(
        "--max-seqs-per-request",
        type=int,
        default=256,
        help="most sequences (n x prompts) one request starts (default 256, vLLM's max-num-seqs)",
    )
    group.add_argument(
        "--responses-ttl-secs",
        type=float,
        default=3600.0,
        help="how long /v1/responses keeps a stored response for previous_response_id and GET (default 3600); "
        "in Redis with --redis-url, so every frontend replica reads it",
    )
    group.add_argument(
        "--responses-max-stored",
        type=int,
        default=10000,
        help="most stored responses; past it the oldest go first (default 10000)",
    )


def request_limits(options: ServeOptions) -> RequestLimits:
    """The OpenAI frontend's RequestLimits of the --max-* request flags; ValueError names a bad flag."""
    from server.openai.limits import RequestLimits

    return RequestLimits.checked(
        max_request_bytes=options.max_request_bytes,
        max_n=options.max_n,
        max_prompts=options.max_prompts_per_request,
        max_seqs=options.max_seqs_per_request,
    )


def response_store(options: ServeOptions) -> ResponseStore:
    """Where /v1/responses stores responses: Redis with --redis-url (every frontend replica reads it), else this
    process's memory; ValueError names a bad flag."""
    from server.openai.response_store import MemoryResponseStore, RedisResponseStore

    if not options.responses_ttl_secs > 0:
        raise ValueError(f"--responses-ttl-secs: must be > 0, got {options.responses_ttl_secs}")
    if options.responses_max_stored < 1:
        raise ValueError(f"--responses-max-stored: must be >= 1, got {options.responses_max_stored}")
    if options.redis_url:
        return RedisResponseStore(options.redis_url, options.responses_ttl_secs, options.responses_max_stored)
    return MemoryResponseStore(options.responses_ttl_secs, options.responses_max_stored)


def _security_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--access-token",
        default=settings.access_token(),
        help="short form of --http-restricted-api and --grpc-restricted-protocol "
        "model-repository,shared-memory,statistics,trace,logging:triton-access-token=TOKEN "
        "(default: $STRATA_ACCESS_TOKEN; unset: open, as in tritonserver)",
    )
    group.add_argument(
        "--http-restricted-api",
        action="append",
        default=[],
        metavar="API[,API]:KEY=VALUE",
        help="tritonserver's flag, passed through: these HTTP APIs need header KEY: VALUE; repeat",
    )
    group.add_argument(
        "--grpc-restricted-protocol",
        action="append",
        default=[],
        metavar="PROTOCOL[,...]:KEY=VALUE",
        help="tritonserver's flag, passed through: these gRPC protocols need metadata KEY: VALUE",
    )
    group.add_argument(
        "--grpc-use-ssl", action="store_true", help="TLS on the gRPC port (tritonserver's flag)"
    )
    group.add_argument("--grpc-use-ssl-mutual", action="store_true", help="mutual TLS on the gRPC port")
    group.add_argument("--grpc-server-cert", default=None, help="PEM certificate of the gRPC port")
    group.add_argument("--grpc-server-key", default=None, help="PEM private key of the gRPC port")
    group.add_argument(
        "--grpc-root-cert", default=None, help="PEM root certificate (clients' CA for mutual TLS)"
    )
    group.add_argument(
        "--api-key",
        default=settings.api_key(),
        help="OpenAI port: require 'Authorization: Bearer KEY' on /v1/* (default: $STRATA_API_KEY)",
    )
    group.add_argument("--ssl-keyfile", default=None, help="OpenAI port: TLS private key (PEM)")
    group.add_argument("--ssl-certfile", default=None, help="OpenAI port: TLS certificate (PEM)")
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='OpenAI port: answer tool_choice "auto" (vLLM\'s flag; needs --tool-call-parser)',
    )
    group.add_argument(
        "--tool-call-parser",
        choices=["hermes"],
        default=None,
        help="OpenAI port: how tool calls are found in a free answer (vLLM's names)",
    )


def _cluster_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--cluster-secret-file",
        type=Path,
        default=None,
        help="file holding the cluster secret that authenticates workers, servers and the KVBM "
        "service to each other and signs G4 blocks (default: $STRATA_CLUSTER_SECRET)",
    )


def cluster_secret(options: ServeOptions | WorkerOptions, needed_by: str | None) -> bytes | None:
    """The cluster secret from --cluster-secret-file or STRATA_CLUSTER_SECRET; ValueError if `needed_by` (the
    flag or command that needs it) is set and there is none, saying how to make one."""
    from cluster.secret import load_secret

    return load_secret(options.cluster_secret_file, settings.cluster_secret(), needed_by)


def triton_access(options: ServeOptions) -> dict[str, object]:
    """TritonSettings fields of the access-control and gRPC TLS flags; ValueError names the flag at fault."""
    from server.triton import GrpcSSL, Restriction

    ssl = None
    if options.grpc_use_ssl or options.grpc_use_ssl_mutual:
        if not (options.grpc_server_cert and options.grpc_server_key):
            raise ValueError("--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key")
        ssl = GrpcSSL(
            options.grpc_server_cert,
            options.grpc_server_key,
            options.grpc_root_cert,
            options.grpc_use_ssl_mutual,
        )
    if bool(options.ssl_keyfile) != bool(options.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    return {
        "access_token": options.access_token,
        "http_restricted": tuple(
            Restriction.parse("--http-restricted-api", v) for v in options.http_restricted_api
        ),
        "grpc_restricted": tuple(
            Restriction.parse("--grpc-restricted-protocol", v) for v in options.grpc_restricted_protocol
        ),
        "grpc_ssl": ssl,
    }


def _engine_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--context-length",
        "--max-model-len",
        type=int,
        default=None,
        help="override max_model_len of every LLM (tokens; --max-model-len is vLLM's name)",
    )
    group.add_argument(
        "--max-concurrent-requests",
        "--max-num-seqs",
        type=int,
        default=None,
        help="override max_concurrent_requests of every LLM engine (--max-num-seqs is vLLM's name)",
    )
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="override max_queued_requests of every LLM engine (default 256 per engine: requests waiting for a "
        "slot; past it a request is refused with 429 + Retry-After, or UNAVAILABLE on Triton)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="override the per-step token budget of every LLM engine",
    )
    group.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default=None,
        help="override scheduling_policy of every Strata LLM engine (vLLM's flag): fcfs (arrival order; a "
        "request's priority must be 0) or priority (lower `priority` first, preempting worse ones)",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="the chat template of every LLM (vLLM's flag): a Jinja template, or a file holding one",
    )
    group.add_argument(
        "--batch-invariant",
        action="store_const",
        const=True,
        default=None,
        help="every LLM engine of Strata's gives a request the same tokens whatever else is in its batch, however "
        "its prompt is chunked or cached, and when it resumes elsewhere (one attention computation per token; "
        "costs throughput, see docs/llm.md)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="override tensor_parallel_size of every LLM (vLLM's flag): each worker runs as this many rank "
        "processes that split every layer's attention heads, KV heads and MLP columns (docs/sharding.md)",
    )
    group.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=None,
        help="override pipeline_parallel_size of every LLM (vLLM's flag): each worker runs as this many stages of "
        "contiguous layers, times the tensor-parallel size in rank processes (docs/sharding.md)",
    )


def _kvbm_flags(kv: argparse._ArgumentGroup) -> None:
    kv.add_argument(
        "--kvbm-host-cache-gb",
        type=float,
        default=1.0,
        help="G2: shared-memory pool for every worker on this node (0: off)",
    )
    kv.add_argument(
        "--kvbm-disk-cache-gb", type=float, default=0.0, help="G3: preallocated disk cache (0: off)"
    )
    kv.add_argument(
        "--kvbm-disk-path",
        type=Path,
        default=Path(".strata-cache/kvbm"),
        help="G3: folder of each worker's block file and its index (relative to the working directory)",
    )
    kv.add_argument(
        "--kvbm-write-through",
        action="store_true",
        help="also write every offloaded block to G4, and every block to G5 as soon as it is computed",
    )
    kv.add_argument(
        "--kvbm-object-url",
        default=None,
        metavar="s3://BUCKET/PREFIX",
        help="G5: KV blocks as objects in an S3-compatible bucket, shared by every server and kept across restarts"
        " (credentials, region and endpoint from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,"
        " AWS_REGION, AWS_ENDPOINT_URL)",
    )
    kv.add_argument(
        "--kvbm-object-cache-gb",
        type=float,
        default=0.0,
        help="G5 bound: past it the least recently used objects this server knows of are deleted (0: unbounded,"
        " leave it to the bucket's lifecycle rule)",
    )
    kv.add_argument(
        "--kvbm-object-timeout-secs", type=float, default=2.0, help="G5 timeout of each object-store request"
    )
    kv.add_argument("--kvbm-redis-ttl-secs", type=int, default=0, help="G4 block expiry (0: none)")
    kv.add_argument("--kvbm-redis-cache-gb", type=float, default=0.0, help="G4 capacity bound (0: unbounded)")
    kv.add_argument("--kvbm-cache-id", default="default", help="node-local name of the G2 segment")
    kv.add_argument(
        "--kvbm-keep-host-cache",
        action="store_true",
        help="leave the G2 segment in /dev/shm when the node's last strata process stops (default: removed)",
    )
    kv.add_argument(
        "--kvbm-flush-secs",
        type=float,
        default=5.0,
        help="on stop, copy G2 blocks to G3 for at most this long, hottest kept (0: no copy)",
    )
    kv.add_argument("--no-kvbm", dest="kvbm", action="store_false", help="G1-only prefix caching")


def _worker_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="serve one LLM model's engine for `strata serve --accept-remote-workers` "
        "servers, found through Redis (one server at a time)",
    )
    p.add_argument("--model-repository", type=Path, required=True, help="repository folder holding the model")
    p.add_argument("--model", required=True, help="the LLM model (folder name) to serve")
    p.add_argument(
        "--redis-url", required=True, help="Redis where servers discover workers (also the G4 tier)"
    )
    p.add_argument("--worker-id", default=None, help="unique per model (default: <hostname>-<pid>)")
    p.add_argument(
        "--role",
        choices=["both", "prefill", "decode"],
        default="both",
        help="disaggregated serving: prefill (prompts and first tokens, KV handed to decode workers), decode, or "
        "both (aggregated); prefill and decode workers join only models served disaggregated",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to bind the worker's two TCP ports on")
    p.add_argument(
        "--advertise-host",
        default=None,
        help="host name servers connect to (default: --host, or this machine's name for 0.0.0.0)",
    )
    p.add_argument("--port", type=int, default=0, help="binds PORT and PORT+1 (0: two free ports)")
    p.add_argument(
        "--kv-transfer-port",
        type=int,
        default=0,
        help="disaggregated serving: port a prefill worker serves KV handoffs on to decode workers of other hosts "
        "(CURVE, cluster secret; 0: any free one, advertised in each handoff)",
    )
    p.add_argument(
        "--lease-secs",
        type=float,
        default=3.0,
        help="registration lease; also how long a silent server is waited for before detaching",
    )
    p.add_argument(
        "--exit-timeout-secs",
        type=int,
        default=30,
        help="on SIGTERM the worker drains: its server routes nothing new to it, and it finishes its requests "
        "for up to this long; what is left then resumes on another worker",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the worker's /metrics and its probes (/health, /v2/health/live, /v2/health/ready: not ready "
        "while draining) over HTTP on this port, bound once the model is loaded (default: none)",
    )
    p.add_argument(
        "--kvbm-service",
        default=None,
        metavar="HOST:PORT",
        help="the servers query a standalone `strata kvbm`: publish block events to Redis for it "
        "(default: send them to the attached server's index)",
    )
    p.add_argument(
        "--vllm-python",
        default=settings.vllm_python(),
        help="the Python of a venv with vLLM (make vllm builds .venv-vllm): for a model with backend vllm the "
        "worker continues under it, same process (default: STRATA_VLLM_PYTHON)",
    )
    _engine_flags(p.add_argument_group("engine overrides"))
    _kvbm_flags(p.add_argument_group("KV Block Manager (tiers below the engine's own pool)"))
    _cluster_flag(p)
    observability = p.add_argument_group("logs and tracing (docs/observability.md)")
    _log_flags(observability)
    _trace_flags(observability)


def _log_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--log-file", default=None, help="append the log here (default: stderr); worker processes too"
    )
    group.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="json: one object per line with the request id and, while tracing, the trace and span ids",
    )


def _trace_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="vLLM's flag: send OpenTelemetry traces over OTLP/HTTP to this collector "
        "(http://host:4318 or its /v1/traces URL); a client's W3C traceparent header is continued "
        "(default: no tracing)",
    )
    group.add_argument(
        "--otlp-traces-sample-ratio",
        type=float,
        default=1.0,
        metavar="R",
        help="the share of new traces recorded, 0 to 1 (a request with a traceparent follows its sampled "
        "flag); default 1.0",
    )


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


def _kvbm_parser(sub: argparse._SubParsersAction) -> None:
    from kvbm.cli import add_service_flags

    p = sub.add_parser(
        "kvbm", help="run the standalone KVBM index service (multi-node: workers publish to Redis)"
    )
    add_service_flags(p)


def kvbm_config(options: ServeOptions | WorkerOptions, secret: bytes | None) -> KVBMConfig | None:
    """The KVBM tiers of the --kvbm-* flags and --redis-url (`strata serve` and `strata worker`); None with
    --no-kvbm. G4 and G5 blocks are signed with a key derived from the cluster `secret` (KVBMConfig refuses
    them without one)."""
    from cluster.secret import derive_key
    from kvbm.config import KVBMConfig
    from kvbm.signing import BLOCK_KEY_PURPOSE

    tiers = options.tiers
    if not tiers.kvbm:
        return None
    kvbm = KVBMConfig(
        host_cache_gb=tiers.kvbm_host_cache_gb,
        disk_cache_gb=tiers.kvbm_disk_cache_gb,
        disk_path=tiers.kvbm_disk_path,
        redis_url=options.redis_url,
        object_url=tiers.kvbm_object_url,
        object_cache_gb=tiers.kvbm_object_cache_gb,
        object_timeout_s=tiers.kvbm_object_timeout_secs,
        write_through=tiers.kvbm_write_through,
        redis_ttl_s=tiers.kvbm_redis_ttl_secs,
        redis_cache_gb=tiers.kvbm_redis_cache_gb,
        cache_id=tiers.kvbm_cache_id,
        keep_host_cache=tiers.kvbm_keep_host_cache,
        flush_budget_s=tiers.kvbm_flush_secs,
        block_key=derive_key(secret, BLOCK_KEY_PURPOSE) if secret else None,
    )
    kvbm.validate()
    return kvbm


def engine_overrides(flags: EngineFlags) -> dict[str, Any]:
    """EngineConfig fields set by --context-length, --max-concurrent-requests, --max-queued-requests,
    --max-num-batched-tokens, --scheduling-policy, --chat-template (a file's text; ValueError naming the flag if it is missing),
    --batch-invariant, --tensor-parallel-size and --pipeline-parallel-size."""
    from server.engine.config import chat_template_text
    from server.errors import ConfigError

    try:
        template = chat_template_text(flags.chat_template, Path.cwd(), "--chat-template")
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return {
        key: value
        for key, value in (
            ("max_model_len", flags.context_length),
            ("max_concurrent_requests", flags.max_concurrent_requests),
            ("max_queued_requests", flags.max_queued_requests),
            ("max_num_batched_tokens", flags.max_num_batched_tokens),
            ("scheduling_policy", flags.scheduling_policy),
            ("chat_template", template),
            ("batch_invariant", flags.batch_invariant),
            ("tensor_parallel_size", flags.tensor_parallel_size),
            ("pipeline_parallel_size", flags.pipeline_parallel_size),
        )
        if value is not None
    }


def build_parser() -> argparse.ArgumentParser:
    """Every `strata` subcommand and its flags."""
    parser = argparse.ArgumentParser(prog="strata", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _worker_parser(sub)
    _kvbm_parser(sub)
    add_planner_parser(sub)
    add_profile_parser(sub, _engine_flags)
    return parser


def command_options(args: argparse.Namespace) -> Options:
    """The typed options of the parsed command (server/options.py): what each command's entry point receives."""
    if args.command == "kvbm":
        from kvbm.cli import service_options

        return service_options(args)
    commands = {
        "serve": ServeOptions,
        "worker": WorkerOptions,
        "planner": PlannerOptions,
        "profile": ProfileOptions,
    }
    return from_flags(commands[args.command], args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # imports no torch: the OpenMP setting below still applies
    if args.command == "worker":
        # `strata worker` processes share a host with others it cannot see (the planner's local connector starts
        # several), each with every core by default; OpenMP's spin-waiting between parallel regions then steals
        # their cores. `strata serve` splits the cores among the workers it starts (deployment._share_cores) and
        # keeps the spin: with one engine, sleeping at every barrier slows each step. An operator's own setting
        # wins (figures: docs/llm.md, "CPU threads").
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    level = logging.DEBUG if getattr(args, "log_verbose", 0) else logging.INFO
    logs = LogSettings(getattr(args, "log_file", None), getattr(args, "log_format", "text"))
    configure_logging(logs, level, args.command)
    return run(command_options(args))


def run(options: Options) -> int:
    """Run the command `options` are of; its exit code."""
    if isinstance(options, ServeOptions):
        from server.serve import serve

        return serve(options)
    if isinstance(options, WorkerOptions):
        from server.workers.remote_worker import run_worker

        try:
            secret = cluster_secret(options, "strata worker (its TCP ports admit only servers that hold it)")
            overrides, kvbm = engine_overrides(options.engine), kvbm_config(options, secret)
        except ValueError as exc:
            logging.getLogger("strata").error("%s", exc)
            return 2
        return run_worker(options, overrides, kvbm, secret)
    if isinstance(options, PlannerOptions):
        return run_planner(options)
    if isinstance(options, ProfileOptions):
        return run_profile(options, engine_overrides(options.engine))
    from kvbm.cli import run as run_service

    try:
        run_service(options)
    except ValueError as exc:  # no cluster secret: the message says how to make one
        logging.getLogger("strata").error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
