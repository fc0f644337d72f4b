"""`strata serve` with G2 and G3, stopped by SIGTERM: the G2 segment is gone from /dev/shm, its blocks are in G3,
and a restart over the same disk cache serves a prompt evicted from G1 before the stop from G3."""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path

import numpy as np
import pytest

from harness.servers import copy_models, triton_generate
from kvbm.config import GIB
from kvbm.disk_pool import PAGE, RECORD
from kvbm.host_pool import SHM_DIR

pytestmark = pytest.mark.slow

BLOCK_BYTES = 737_280  # SmolLM2-135M fp32, 16 tokens
TOPICS = ("the printing press", "the steam engine", "the telegraph", "penicillin")


def document(topic: str) -> str:
    """About 300 tokens (19 blocks): two of them fill the 40-block G1 pool, so the first is evicted to G2."""
    sentences = [
        f"Paragraph {i} is about {topic} and how it changed daily life in town {i}." for i in range(16)
    ]
    return " ".join(sentences) + " In one sentence, the main effect was"


def generate(server, prompt: str) -> dict:
    return triton_generate(server, prompt, max_tokens=1)


def g3_blocks(disk_path: Path) -> int:
    """Blocks recorded in the in-process engine's G3 index (worker id smollm2-0)."""
    (index,) = (disk_path / "smollm2-0").glob("*/index.dat")
    records = np.frombuffer(index.read_bytes()[PAGE:], dtype=RECORD)
    return int(np.count_nonzero(records["seq"]))


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    repo = copy_models(tmp_path / "repo", "smollm2")
    model_json = repo / "smollm2" / "1" / "model.json"
    settings = json.loads(model_json.read_text())
    settings.update(num_kv_blocks=40, max_model_len=1024, max_concurrent_requests=1)
    model_json.write_text(json.dumps(settings))
    return repo


def test_sigterm_g2_to_g3(strata, repository, tmp_path):
    """Named short: the test folder holds Triton's workspace, whose socket paths have a length limit."""
    cache_id = f"test-{uuid.uuid4().hex[:12]}"
    disk_path = tmp_path / "kvbm"
    flags = (
        "--kvbm-cache-id", cache_id, "--kvbm-host-cache-gb", str(64 * BLOCK_BYTES / GIB),
        "--kvbm-disk-cache-gb", str(256 * BLOCK_BYTES / GIB), "--kvbm-disk-path", str(disk_path),
    )  # fmt: skip
    server = strata(repository, *flags)
    assert len(list(SHM_DIR.glob(f"strata-kvbm-{cache_id}-*"))) == 1
    for topic in TOPICS[:3]:
        generate(server, document(topic))
    assert server.stop(signal.SIGTERM) == 0
    assert not list(SHM_DIR.glob(f"strata-kvbm-{cache_id}-*"))
    assert "G2 blocks" in server.log() and g3_blocks(disk_path) >= 19  # at least the evicted first prompt

    restarted = strata(repository, *flags)
    assert generate(restarted, document(TOPICS[0]))["num_cached_tokens"] >= 16 * 18
    assert restarted.stop(signal.SIGTERM) == 0
    assert not list(SHM_DIR.glob(f"strata-kvbm-{cache_id}-*"))


def test_sigterm_workers_2(strata, repository, tmp_path):
    """With --workers 2 the worker processes map the segment, not the server: the last one to stop removes it."""
    cache_id = f"test-{uuid.uuid4().hex[:12]}"
    disk_path = tmp_path / "kvbm"
    flags = (
        "--workers", "2", "--kvbm-cache-id", cache_id, "--kvbm-host-cache-gb", str(64 * BLOCK_BYTES / GIB),
        "--kvbm-disk-cache-gb", str(256 * BLOCK_BYTES / GIB), "--kvbm-disk-path", str(disk_path),
    )  # fmt: skip
    server = strata(repository, *flags)
    assert len(list(SHM_DIR.glob(f"strata-kvbm-{cache_id}-*"))) == 1
    for topic in TOPICS:
        generate(server, document(topic))
    assert server.stop(signal.SIGTERM) == 0
    assert not list(SHM_DIR.glob(f"strata-kvbm-{cache_id}-*"))
    assert server.log().count("(last process to close it)") == 1
