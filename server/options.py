"""The parsed flags of each `strata` command as one typed, frozen object, built once by `server/cli.py` right after
argparse; nothing past the command line sees an `argparse.Namespace`.

A field's name is its flag's argparse dest (`--kvbm-flush-secs` -> `kvbm_flush_secs`), so `from_flags` needs no
mapping. A field typed as a Struct is a group of flags that several commands share (`EngineFlags` in serve, worker
and profile; `KVBMFlags` in serve and worker; `SLAFlags` in serve --planner and planner): it is built from the same
flags. Ranges and rules that involve several flags are checked where the flags are used (serve.llm_serving,
planner.cli.planner_config), and the config objects built from them check their own fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

import msgspec

if TYPE_CHECKING:
    import argparse

Options = TypeVar("Options", bound=msgspec.Struct)


class EngineFlags(msgspec.Struct, frozen=True):
    """Engine overrides (--context-length, --max-concurrent-requests, ...); None: the model.json value."""

    context_length: int | None = None  # tokens: max_model_len
    max_concurrent_requests: int | None = None
    max_queued_requests: int | None = None
    max_num_batched_tokens: int | None = None  # tokens per step
    scheduling_policy: str | None = None  # fcfs or priority
    chat_template: str | None = None  # Jinja text, or a file of it
    batch_invariant: bool | None = None  # True: --batch-invariant
    tensor_parallel_size: int | None = None  # ranks per worker splitting each layer
    pipeline_parallel_size: int | None = None  # stages of layers per worker


class KVBMFlags(msgspec.Struct, frozen=True):
    """The --kvbm-* tier flags; `kvbm` False is --no-kvbm (G1 only)."""

    kvbm: bool
    kvbm_host_cache_gb: float
    kvbm_disk_cache_gb: float
    kvbm_disk_path: Path
    kvbm_write_through: bool
    kvbm_object_url: str | None
    kvbm_object_cache_gb: float
    kvbm_object_timeout_secs: float
    kvbm_redis_ttl_secs: int
    kvbm_redis_cache_gb: float
    kvbm_cache_id: str
    kvbm_keep_host_cache: bool
    kvbm_flush_secs: float


class SLAFlags(msgspec.Struct, frozen=True):
    """The planner's targets (seconds), interval (seconds), predictor and worker bounds."""

    ttft_target: float | None
    itl_target: float | None
    adjustment_interval: float
    predictor: str
    min_workers: int
    max_workers: int
    max_total_workers: int
    follow_last: bool
    scale_down_intervals: int


class ServeOptions(msgspec.Struct, frozen=True):
    """`strata serve`."""

    model_repository: tuple[Path, ...]
    model_control_mode: Literal["none", "poll", "explicit"]
    repository_poll_secs: float
    load_model: tuple[str, ...]
    http_address: str
    http_port: int
    grpc_port: int
    metrics_port: int
    strict_readiness: bool
    exit_timeout_secs: int
    log_verbose: int
    # what Triton's core does for file models (tritonserver's flags)
    disable_auto_complete_config: bool
    strict_model_config: bool
    cache_config: tuple[str, ...]
    rate_limit: str
    rate_limit_resource: tuple[str, ...]
    openai_port: int
    allow_openai: bool
    # OpenAI request limits
    max_request_bytes: int
    max_n: int
    max_prompts_per_request: int
    max_seqs_per_request: int
    responses_ttl_secs: float
    responses_max_stored: int
    # LLM serving
    vllm_python: str | None
    workers: int | None
    routing_strategy: str
    router_fallback: str
    router_temperature: float
    router_overlap_weight: float
    router_busy_threshold: float
    router_count_in_flight: bool
    migration_limit: int
    prefill_workers: int | None
    decode_workers: int | None
    max_local_prefill_length: int
    max_prefill_queue_size: int
    accept_remote_workers: bool
    engine: EngineFlags
    # KV Block Manager
    tiers: KVBMFlags
    cluster_secret_file: Path | None
    redis_url: str | None
    kvbm_service: str | None
    # SLA planner (--planner MODEL)
    planner: str | None
    planner_profile: Path | None
    planner_worker_args: str
    sla: SLAFlags
    # access control and TLS
    access_token: str | None
    http_restricted_api: tuple[str, ...]
    grpc_restricted_protocol: tuple[str, ...]
    grpc_use_ssl: bool
    grpc_use_ssl_mutual: bool
    grpc_server_cert: str | None
    grpc_server_key: str | None
    grpc_root_cert: str | None
    api_key: str | None
    ssl_keyfile: str | None
    ssl_certfile: str | None
    enable_auto_tool_choice: bool
    tool_call_parser: str | None
    # logs, tracing and browsers
    log_file: str | None
    log_format: Literal["text", "json"]
    otlp_traces_endpoint: str | None
    otlp_traces_sample_ratio: float
    trace_config: tuple[str, ...]
    disable_uvicorn_access_log: bool
    allowed_origins: tuple[str, ...] | None
    allowed_methods: tuple[str, ...]
    allowed_headers: tuple[str, ...]
    allow_credentials: bool
    cors_admin_routes: bool


class WorkerOptions(msgspec.Struct, frozen=True):
    """`strata worker`."""

    model_repository: Path
    model: str
    redis_url: str
    worker_id: str | None
    role: Literal["both", "prefill", "decode"]
    host: str
    advertise_host: str | None
    port: int
    kv_transfer_port: int
    lease_secs: float
    exit_timeout_secs: int
    metrics_port: int | None
    kvbm_service: str | None
    vllm_python: str | None
    engine: EngineFlags
    tiers: KVBMFlags
    cluster_secret_file: Path | None
    log_file: str | None
    log_format: Literal["text", "json"]
    otlp_traces_endpoint: str | None
    otlp_traces_sample_ratio: float


class PlannerOptions(msgspec.Struct, frozen=True):
    """`strata planner`."""

    model: str
    metrics_url: str
    profile: Path
    sla: SLAFlags
    aggregated: bool
    connector: Literal["local", "kubernetes"]
    dry_run: bool
    metrics_port: int
    disagg_url: str | None
    api_key: str | None
    # local connector
    model_repository: Path | None
    redis_url: str | None
    worker_args: str
    exit_timeout_secs: int
    # Kubernetes connector
    namespace: str | None
    deployment: tuple[str, ...]
    lease_name: str | None
    identity: str | None


class ProfileOptions(msgspec.Struct, frozen=True):
    """`strata profile`: lengths in tokens."""

    model_repository: Path
    model: str
    output: Path
    prompt_lengths: tuple[int, ...]
    concurrency: tuple[int, ...]
    contexts: tuple[int, ...]
    decode_tokens: int
    repeats: int
    engine: EngineFlags


def from_flags(cls: type[Options], flags: argparse.Namespace) -> Options:
    """`cls` of the parsed `flags`: each field from the flag of the same dest, each group from the same flags."""
    values = {
        field.name: from_flags(field.type, flags) if _is_group(field.type) else getattr(flags, field.name)
        for field in msgspec.structs.fields(cls)
    }
    return msgspec.convert(values, cls)


def _is_group(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, msgspec.Struct)
