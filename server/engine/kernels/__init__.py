"""C++ kernels for the CPU engine, compiled on this machine the first time they are asked for.

`cpu_kernels()` returns the compiled module: `decode_attention` (paged_attention.cpp), `prefill_attention`
(prefill_attention.cpp, bf16 on AMX tiles or AVX512-BF16 registers: `prefill_attention_isas()` says which this
build and OS have, best first), the fused elementwise ops of a layer (fused_ops.cpp: `rms_norm`, `add_rms_norm`,
`silu_mul`, `rope_cache`) and bf16 linear layers on AVX512-BF16 (linear_bf16.cpp: `pack_bf16_linear`,
`bf16_linear`, `bf16_linear_available()`) and the shared-memory all-reduce of a sharded worker's ranks
(shm_allreduce.cpp: `shm_allreduce_init`, `shm_allreduce_bytes`, `shm_allreduce`, `shm_allreduce_abort`); None when it cannot be built here (no C++ compiler, or a torch build without headers), and the engine then takes its torch path and says so
once in the log. The build (`-O3 -march=native`) is cached under `<cache>/kernels/`, keyed
by torch's version and this CPU (and by the sources and flags), so `make install` builds it once
(`python -m server.engine.kernels`) and every process after loads it in well under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import platform
import subprocess
import threading
from pathlib import Path
from types import ModuleType

import torch

from server import settings

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "paged_attention.cpp",
        "prefill_attention.cpp",
        "fused_ops.cpp",
        "linear_bf16.cpp",
        "shm_allreduce.cpp",
        "bindings.cpp",
    )
]
HEADERS = [Path(__file__).with_name("cpu_math.h")]  # part of the build's key, not compiled on their own
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def build_dir() -> Path:
    """Where the build lives: `<STRATA_CACHE_DIR or ~/.cache/strata>/kernels/torch-<version>-<cpu>`, where <cpu>
    hashes this CPU's model name and feature flags: a build for another CPU (a container image built elsewhere)
    is never loaded, since `-march=native` code can fault there."""
    return settings.cache_dir() / "kernels" / f"torch-{torch.__version__}-{_cpu_fingerprint()}"


def _cpu_fingerprint() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = [platform.processor(), platform.machine()]
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return hashlib.blake2b("\n".join(sorted(set(wanted))).encode(), digest_size=6).hexdigest()


def cpu_kernels() -> ModuleType | None:
    """The compiled kernels module, built on first use; None when it cannot be built here."""
    with _lock:
        if "cpu" not in _loaded:
            _loaded["cpu"] = _load("strata_cpu_kernels", SOURCES, HEADERS)
        return _loaded["cpu"]


def _load(name: str, sources: list[Path], headers: list[Path]) -> ModuleType | None:
    """Import the build for these sources and flags if there is one (no lock, no compiler), else build it.
    Loading a finished build directly matters: torch's builder serialises on a lock file that a process killed
    mid-build would leave behind, and every engine start would wait on it."""
    content = b"".join(path.read_bytes() for path in sources + headers) + " ".join(FLAGS).encode()
    digest = hashlib.blake2b(content, digest_size=8).hexdigest()
    directory = build_dir() / digest
    library = directory / f"{name}.so"
    if library.exists():
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return _build(name, sources, directory)


def _build(name: str, sources: list[Path], directory: Path) -> ModuleType | None:
    from torch.utils import cpp_extension

    try:
        directory.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(source) for source in sources],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        log.warning(
            "CPU kernels unavailable, the engine runs torch ops (decode attention gathers K/V): %s",
            first_line,
        )
        return None
