"""Where the server reads Strata's own environment variables (STRATA_*). Elsewhere: kvbm's CLI reads
STRATA_CLUSTER_SECRET itself, a child process reads what its parent set for it (STRATA_WORKER_CPUS, the block key),
and a few other programs' variables are read where they apply (VLLM_CPU_*, POD_NAME, AWS_ENDPOINT_URL)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Where converted model weights are cached (STRATA_CACHE_DIR, default ~/.cache/strata)."""
    return Path(os.environ.get("STRATA_CACHE_DIR") or Path.home() / ".cache" / "strata")


def runtime_dir() -> Path:
    """Where each server run keeps its Triton workspace (STRATA_RUNTIME_DIR, default <tmp>/strata-runtime)."""
    return Path(os.environ.get("STRATA_RUNTIME_DIR") or Path(tempfile.gettempdir()) / "strata-runtime")


def access_token() -> str | None:
    """Token that protects Triton's repository/statistics/shm/trace/logging APIs (STRATA_ACCESS_TOKEN)."""
    return os.environ.get("STRATA_ACCESS_TOKEN") or None


def api_key() -> str | None:
    """Bearer key required on the OpenAI port's /v1/* routes (STRATA_API_KEY; vLLM reads VLLM_API_KEY)."""
    return os.environ.get("STRATA_API_KEY") or None


def vllm_python() -> str | None:
    """The Python of a venv with vLLM, for models with backend vllm (STRATA_VLLM_PYTHON)."""
    return os.environ.get("STRATA_VLLM_PYTHON") or None


def cluster_secret() -> str | None:
    """The cluster secret itself (STRATA_CLUSTER_SECRET), when no --cluster-secret-file names a file."""
    return os.environ.get("STRATA_CLUSTER_SECRET") or None
