"""A Triton vLLM-backend model.json read on the server's side (no vLLM needed)."""

from __future__ import annotations

import json

import pytest

from server.errors import ConfigError
from server.vllm_engine.config import CPU_BIND_ENV, VLLMConfig, cpu_binds


def write(tmp_path, body) -> object:
    path = tmp_path / "1" / "model.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return path


def test_tritons_documented_file_reads_with_its_renamed_key(tmp_path):
    path = write(
        tmp_path,
        {"model": "facebook/opt-125m", "disable_log_requests": True, "gpu_memory_utilization": 0.5,
         "enforce_eager": True},
    )  # fmt: skip
    config = VLLMConfig.from_json(path)
    assert config.engine_args == {
        "model": "facebook/opt-125m", "gpu_memory_utilization": 0.5, "enforce_eager": True,
        "enable_log_requests": False,
    }  # fmt: skip
    assert config.source == str(path) and config.max_model_len == 4096


def test_a_model_folder_next_to_model_json_resolves(tmp_path):
    path = write(tmp_path, {"model": "weights", "max_model_len": 2048})
    (path.parent / "weights").mkdir()
    config = VLLMConfig.from_json(path)
    assert config.engine_args["model"] == str((path.parent / "weights").resolve())
    assert config.max_model_len == 2048


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"model": "x",\n  oops}', ":2:"),
        ("[1, 2]", "expected `object`, got `array`"),
        ({"dtype": "float32"}, "model: missing (required), must be a non-empty string"),
        ({"model": ""}, "model: must be a non-empty string (a local model folder), got ''"),
        ({"model": "x", "max_num_seqs": 0}, "max_num_seqs: must be a positive integer, got 0"),
        ({"model": "x", "kv_events_config": {}}, "kv_events_config: set by Strata"),
    ],
)
def test_bad_files_name_the_file_and_the_problem(tmp_path, body, expected):
    with pytest.raises(ConfigError) as raised:
        VLLMConfig.from_json(write(tmp_path, body))
    assert "model.json" in str(raised.value) and expected in str(raised.value)


def test_serve_flags_map_to_vllms_arguments(tmp_path):
    config = VLLMConfig.from_json(write(tmp_path, {"model": "x", "max_num_seqs": 8}))
    config.apply_overrides({"max_model_len": 1024, "max_concurrent_requests": 4, "max_queued_requests": 9})
    assert config.engine_args == {"model": "x", "max_num_seqs": 4, "max_model_len": 1024}
    assert config.max_queued_requests == 9 and config.ignored_overrides == []


def test_local_vllm_workers_get_disjoint_cores(monkeypatch):
    monkeypatch.delenv(CPU_BIND_ENV, raising=False)
    assert cpu_binds({}, 1, [0, 1]) is None  # one worker: vLLM's auto binding
    assert cpu_binds({}, 2, [0, 1]) == ["0", "1"]
    assert cpu_binds({}, 2, [0, 1, 2, 3, 4]) == ["0,1", "2,3"]
    assert cpu_binds({"tensor_parallel_size": 2}, 2, list(range(8))) == ["0,1|2,3", "4,5|6,7"]
    assert cpu_binds({"tensor_parallel_size": 2}, 2, [0, 1]) == ["0|1", "0|1"]  # no core per rank: in turn
    # one worker of 3 ranks: vLLM's auto binding wants a NUMA node per rank, so Strata binds them
    assert cpu_binds({"tensor_parallel_size": 3}, 1, [0, 1]) == ["0|1|0"]
    assert cpu_binds({"pipeline_parallel_size": 2}, 1, [0, 1, 2, 3]) == ["0,1|2,3"]
    monkeypatch.setenv(CPU_BIND_ENV, "nobind")
    assert cpu_binds({}, 2, [0, 1]) is None  # the operator's setting wins
