"""StrataKVConnector: a vLLM engine offloads its KV blocks to Strata's G2 as it computes them and onboards them on a
prefix hit after vLLM's own pool evicted them (kvbm_check.py runs the engine in the vLLM venv `make vllm` builds)."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from kvbm.host_pool import SHM_DIR
from server.engine.config import DEFAULT_MODEL
from server.engine.loader import prepare_model
from server.workers.external import SOURCE_ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report() -> dict:
    python = os.environ.get("STRATA_VLLM_PYTHON")
    if not python:
        pytest.skip("STRATA_VLLM_PYTHON is not set (make test sets it to the venv `make vllm` builds)")
    cache_id = f"test-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(SOURCE_ROOT), "HF_HUB_OFFLINE": "1"}
    script = Path(__file__).with_name("kvbm_check.py")
    folder = prepare_model(DEFAULT_MODEL).folder
    done = subprocess.run(
        [python, str(script), str(folder), cache_id], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert not list(Path(SHM_DIR).glob(f"strata-kvbm-{cache_id}-*")), "the last user removes the G2 segment"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_evicted_prefix_comes_back_from_g2_with_the_same_answer(report):
    full_blocks = (report["prompt_tokens"] - 1) // 128  # vLLM computes the last prompt token itself
    assert report["first"]["cached_tokens"] == 0
    assert report["evicted_from_g1"], "the fill requests should have evicted the prefix from vLLM's pool"
    assert report["in_g2"] == report["prompt_tokens"] // 128  # every full prompt block was written through
    assert report["again"]["cached_tokens"] == full_blocks * 128
    assert report["again"]["token_ids"] == report["first"]["token_ids"]
    assert report["again"]["error"] is None


def test_a_cache_salt_keeps_tenants_apart(report):
    """The same prompt under a cache_salt finds nothing of the unsalted blocks and is stored under its own hashes."""
    assert report["salted"]["cached_tokens"] == 0
    assert report["salted"]["token_ids"] == report["first"]["token_ids"]
    assert report["salted_in_g2"] == report["prompt_tokens"] // 128
