"""How `LLMDeployment.plan` sizes a model's engine processes: threads split across its local workers."""

from __future__ import annotations

import json
import logging
import os

import pytest

from harness.servers import copy_models
from server.deployment import LLMDeployment, LLMServing
from server.repository.scan import read_model

CORES = len(os.sched_getaffinity(0))


def plan(tmp_path, workers: int | None, **model_json):
    repository = copy_models(tmp_path, "smollm2")
    path = repository / "smollm2" / "1" / "model.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **model_json}))
    return LLMDeployment(LLMServing(workers=workers)).plan(read_model(repository / "smollm2"))


def test_one_engine_keeps_every_core(tmp_path):
    assert plan(tmp_path, None).config.num_threads is None  # torch's default: every core


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_local_workers_split_the_cores(tmp_path, workers):
    result = plan(tmp_path, workers)
    assert result.workers == workers
    assert result.config.num_threads == max(1, CORES // workers)


def test_num_threads_in_model_json_wins_and_oversubscription_is_logged(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="server.deployment"):
        result = plan(tmp_path, 2, num_threads=CORES)
    assert result.config.num_threads == CORES
    assert "exceed this host's" in caplog.text and "num_threads" in caplog.text
