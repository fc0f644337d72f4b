"""A model folder written for Triton's vLLM backend: `config.pbtxt` says `backend: "vllm"` and `<version>/model.json`
holds vLLM's engine arguments (`AsyncEngineArgs` fields) as Triton's docs show them:

    {"model": "facebook/opt-125m", "disable_log_requests": true, "gpu_memory_utilization": 0.5,
     "enforce_eager": true}

The server reads the file and checks its shape here; the worker that runs vLLM checks each argument against the
installed vLLM (`engine.py`), so an unknown or bad one fails the model's load with the file and key named.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec

from kvbm.config import KVBMConfig
from server.engine.config import chat_template_text
from server.errors import ConfigError, PositiveInt, config_error, read_json

log = logging.getLogger(__name__)

# Set by Strata on every vLLM engine: it subscribes to these events and reads these stats itself.
MANAGED_ARGS = ("kv_events_config", "disable_log_stats")
# Triton's documented model.json still says this; vLLM 0.10 replaced it with enable_log_requests (default off).
RENAMED_ARGS = {"disable_log_requests": ("enable_log_requests", lambda value: not value)}
# `strata serve` flags (EngineConfig names) that have a vLLM engine argument; max_queued_requests bounds the
# adapter's own queue, as it bounds Strata's engine's.
OVERRIDES = {
    "max_model_len": "max_model_len",
    "max_concurrent_requests": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "tensor_parallel_size": "tensor_parallel_size",
    "pipeline_parallel_size": "pipeline_parallel_size",
}
DEFAULT_MAX_QUEUED_REQUESTS = 256
DEFAULT_MAX_MODEL_LEN = 4096  # only until the first worker says what vLLM derived from the model
CPU_BIND_ENV = (
    "VLLM_CPU_OMP_THREADS_BIND"  # vLLM CPU: the cores of each rank's OpenMP threads, ranks split by "|"
)


class CheckedArgs(msgspec.Struct):
    """The engine arguments Strata itself reads or overrides, checked on the server's side; model.json's other
    keys go to vLLM as written, which checks them in the worker (engine.py), so unknown keys are allowed here."""

    # a local model folder (config.json, weights, tokenizer): nothing is downloaded
    model: Annotated[str, msgspec.Meta(min_length=1, description="a non-empty string (a local model folder)")]
    # tokens: prompt + output (None: vLLM derives it from the model); --context-length sets it
    max_model_len: PositiveInt | None = None
    # sequences running at once; --max-concurrent-requests sets it
    max_num_seqs: PositiveInt | None = None
    # tokens computed per step; --max-num-batched-tokens sets it
    max_num_batched_tokens: PositiveInt | None = None
    # vLLM's ranks splitting every layer; --tensor-parallel-size sets it
    tensor_parallel_size: PositiveInt = 1
    # vLLM's stages of layers; --pipeline-parallel-size sets it
    pipeline_parallel_size: PositiveInt = 1


@dataclass(frozen=True, slots=True)
class VLLMParallel:
    """vLLM's parallel settings, read once from its engine arguments (checked by CheckedArgs on the server)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @classmethod
    def of(cls, engine_args: Mapping[str, Any]) -> VLLMParallel:
        return cls(
            int(engine_args.get("tensor_parallel_size") or 1),
            int(engine_args.get("pipeline_parallel_size") or 1),
        )

    @property
    def world_size(self) -> int:
        """vLLM's ranks: every stage's tensor-parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(slots=True)
class VLLMConfig:
    """vLLM's engine arguments for one model, as the worker will pass them to `AsyncEngineArgs`."""

    engine_args: dict[str, Any]
    source: str  # the model.json, for error messages the worker sends back
    model_name: str | None = None  # the served name (the model's folder)
    max_queued_requests: int = (
        DEFAULT_MAX_QUEUED_REQUESTS  # past running + this many, submit is refused (429)
    )
    ignored_overrides: list[str] = field(default_factory=list)
    chat_template: str | None = (
        None  # model.json's chat_template (not a vLLM engine argument) or --chat-template
    )

    @property
    def max_model_len(self) -> int:
        return self.engine_args.get("max_model_len") or DEFAULT_MAX_MODEL_LEN

    @property
    def parallel(self) -> VLLMParallel:
        return VLLMParallel.of(self.engine_args)

    @classmethod
    def from_json(cls, path: str | Path) -> VLLMConfig:
        """Read a vLLM-backend model.json; errors name the file (and the line, for JSON syntax)."""
        path = Path(path)
        raw = read_json(path)
        try:
            model = msgspec.convert(raw, CheckedArgs).model
        except msgspec.ValidationError as exc:
            raise config_error(path, exc, CheckedArgs, raw) from None
        for key in MANAGED_ARGS:
            if key in raw:
                raise ConfigError(path, f"{key}: set by Strata on every vLLM engine; remove it")
        for old, (new, convert) in RENAMED_ARGS.items():
            if old in raw:
                raw[new] = convert(raw.pop(old))
        local = path.parent / model
        if not Path(model).is_absolute() and local.exists():
            raw["model"] = str(local.resolve())  # a folder next to model.json, as for Strata's engine
        template = raw.pop("chat_template", None)  # vLLM's server takes it, not its engine
        if template is not None and not isinstance(template, str):
            raise ConfigError(path, "chat_template: expected a Jinja template or a file name")
        return cls(raw, str(path), chat_template=chat_template_text(template, path.parent, path))

    def worker_args(self, kvbm: KVBMConfig | None) -> dict[str, Any]:
        """The keyword arguments of `engine.build_vllm_engine` in a worker (JSON values), with `kvbm`'s tiers."""
        return {
            "engine_args": self.engine_args, "source": self.source, "model_name": self.model_name,
            "max_queued_requests": self.max_queued_requests,
            "kvbm": kvbm.to_json() if kvbm is not None else None, "chat_template": self.chat_template,
        }  # fmt: skip

    def apply_overrides(self, overrides: dict[str, Any]) -> None:
        """`strata serve` flags that set engine fields: those vLLM has take the place of model.json's values."""
        for key, value in overrides.items():
            arg = OVERRIDES.get(key)
            if key == "max_queued_requests":
                self.max_queued_requests = value
            elif key == "chat_template":
                self.chat_template = value
            elif arg is None:
                self.ignored_overrides.append(key)
            else:
                self.engine_args[arg] = value
        if self.ignored_overrides:
            log.warning(
                "%s: %s do not apply to the vLLM engine (set vLLM's engine arguments in model.json)",
                self.source,
                ", ".join(sorted(self.ignored_overrides)),
            )


def cpu_binds(engine_args: dict[str, Any], workers: int, cores: list[int] | None = None) -> list[str] | None:
    """One VLLM_CPU_OMP_THREADS_BIND value per local vLLM worker: disjoint core ranges, each split among the
    worker's tensor/pipeline ranks. vLLM's own "auto" binding looks at one process only, so every worker of a
    host binds the same cores (two SmolLM2 workers on 2 cores: both on core 1), and it refuses more ranks than
    NUMA nodes. Where a core per rank does not go round, ranks share cores in turn ("0|1|0": 3 ranks on 2 cores).
    None when one worker of one rank keeps vLLM's auto binding, or when the operator set the variable."""
    ranks = VLLMParallel.of(engine_args).world_size
    if (workers < 2 and ranks < 2) or CPU_BIND_ENV in os.environ:
        return None
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    per_rank = len(cores) // (workers * ranks)
    if per_rank == 0:
        log.warning(
            "%d vLLM workers x %d ranks on %d cores: ranks share cores in turn (each step waits on the slowest)",
            workers, ranks, len(cores),
        )  # fmt: skip
        return [
            "|".join(str(cores[(w * ranks + r) % len(cores)]) for r in range(ranks)) for w in range(workers)
        ]
    per_worker = per_rank * ranks
    binds = []
    for worker in range(workers):
        mine = cores[worker * per_worker : (worker + 1) * per_worker]
        binds.append(
            "|".join(",".join(map(str, mine[r * per_rank : (r + 1) * per_rank])) for r in range(ranks))
        )
    return binds
