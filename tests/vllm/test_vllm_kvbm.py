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


def run_check(vllm_python: str, *args: str) -> dict:
    """kvbm_check.py under the vLLM venv with the SmolLM2 folder and `args`: its JSON line, and its log as "log"."""
    env = {**os.environ, "PYTHONPATH": str(SOURCE_ROOT), "HF_HUB_OFFLINE": "1"}
    script = Path(__file__).with_name("kvbm_check.py")
    folder = prepare_model(DEFAULT_MODEL).folder
    done = subprocess.run(
        [vllm_python, str(script), str(folder), *args], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {
        **json.loads(done.stdout.strip().splitlines()[-1]),
        "log": done.stderr + done.stdout,
    }  # vLLM logs to stdout


@pytest.fixture(scope="module")
def report(vllm_python) -> dict:
    cache_id = f"test-{uuid.uuid4().hex[:8]}"
    report = run_check(vllm_python, cache_id)
    assert not list(Path(SHM_DIR).glob(f"strata-kvbm-{cache_id}-*")), "the last user removes the G2 segment"
    return report


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


def test_announce_publishes_what_the_engine_holds_again(report):
    """For a server that attaches the worker later, or a KVBM service that restarted: the G1 blocks vLLM holds
    (from the relay's map) and every block the connector's G2 holds (not every block it ever stored: a full G2 set
    evicts one while the pool has room)."""
    announced = report["announce"]
    assert announced["g1"] > 0 and announced["g1_known"]
    assert announced["g2_held"] > 0 and announced["g2"] == announced["g2_held"] and announced["g2_all"]


def test_with_the_kvbm_service_its_index_sees_the_vllm_worker_and_gets_it_back_after_a_restart(
    vllm_python, redis_url
):
    """`--kvbm-service`: no server index to forward to; vLLM's G1 events and the connector's G2 events go to Redis
    under the worker's lease, and a service restarted on an empty Redis gets them again from the announcement."""
    report = run_check(vllm_python, f"test-{uuid.uuid4().hex[:8]}", redis_url)
    full = report["full_blocks"]
    assert report["before"] == [full, full]  # G1 from vLLM's events, G2 from StrataKVConnector's
    assert report["after_restart"] == [full, full]


def test_a_block_that_fails_to_load_is_recomputed_and_the_answer_is_unchanged(vllm_python, tmp_path):
    """The lookup said G3 holds the whole prefix; the third block's bytes on disk were overwritten since. The
    connector delivers the two before it, reports the rest as load errors, and vLLM recomputes them."""
    report = run_check(vllm_python, "-", str(tmp_path))
    assert report["evicted_from_g1"] and report["in_g3"] == report["prompt_tokens"] // 128
    assert report["again"]["error"] is None
    assert report["again"]["token_ids"] == report["first"]["token_ids"]
    assert "G3 checksum mismatch" in report["log"]
    # blocks 2..4 (of 5) were not delivered; vLLM still counts them in cached_tokens, set before the load ran
    assert "StrataKVConnector: 3 blocks failed to load; vLLM recomputes them" in report["log"]


def test_the_connector_leaves_vllms_cpu_thread_reservation_as_without_one(report):
    """vLLM reserves one more core whenever a connector is attached (for NIXL); Strata's keeps the one core per
    rank vLLM reserves for its scheduler without a connector (engine._keep_cpu_layout)."""
    if {"VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND"} & set(os.environ):
        pytest.skip("the operator's own CPU binding is in force")
    assert "reserve_cpu_num=1" in report["log"]


def test_a_second_vllm_engine_answers_from_the_bucket(vllm_python, object_url):
    """G5 only: the first engine's blocks reach the bucket as it computes them; a second engine, with nothing
    of the first in memory, gets every full block of the prompt from there and gives the same answer."""
    report = run_check(vllm_python, "unused", object_url)
    full_blocks = (report["prompt_tokens"] - 1) // 128
    assert report["first"]["cached_tokens"] == 0
    assert report["first_g5_stored"] == report["prompt_tokens"] // 128
    assert report["again"]["cached_tokens"] == full_blocks * 128
    assert report["again"]["token_ids"] == report["first"]["token_ids"]
