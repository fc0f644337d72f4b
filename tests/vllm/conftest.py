"""The vLLM venv these tests run vLLM under: `make test` sets STRATA_VLLM_PYTHON; without it, they skip."""

from __future__ import annotations

import os
import subprocess

import pytest


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get("STRATA_VLLM_PYTHON")
    if not python:
        pytest.skip("STRATA_VLLM_PYTHON is not set (make test sets it to the venv `make vllm` builds)")
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, f"STRATA_VLLM_PYTHON={python} cannot import vllm:\n{probe.stderr[-2000:]}"
    return python
