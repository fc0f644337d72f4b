"""The vLLM venv these tests run vLLM under: STRATA_VLLM_PYTHON, else the repository's .venv-vllm (what `make vllm`
builds); with neither, they skip."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get("STRATA_VLLM_PYTHON") or (
        str(REPO_VLLM_PYTHON) if REPO_VLLM_PYTHON.exists() else None
    )
    if not python:
        pytest.skip("no vLLM venv: set STRATA_VLLM_PYTHON or run `make vllm` (it builds .venv-vllm)")
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, f"STRATA_VLLM_PYTHON={python} cannot import vllm:\n{probe.stderr[-2000:]}"
    return python


@pytest.fixture(scope="module", autouse=True)
def _no_compile_on_first_use() -> Iterator[None]:
    """vLLM torch.compiles a few small ops with inductor the first time they run (its logprobs count, its top-k/p
    sampler): on a machine with an empty compile cache, such as CI's, that is a C++ build of minutes on two busy
    cores inside the first request that asks for logprobs (seen: a 120-s client timeout). The processes these
    files start run those ops eagerly (TORCH_COMPILE_DISABLE, read when they import torch); the model itself runs
    eagerly anyway (enforce_eager)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_COMPILE_DISABLE", "1")
        yield
