"""The example repository through real Triton: tritonclient HTTP and gRPC, inference, errors, metrics."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from harness.servers import copy_models, start_strata

MODELS = ("add_sub", "string_upper", "torch_linear")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serving")
    process = start_strata(copy_models(tmp / "repo", *MODELS), tmp)
    yield process
    process.stop()


@pytest.fixture(params=["http", "grpc"])
def client(request, server):
    module = httpclient if request.param == "http" else grpcclient
    url = server.http_url if request.param == "http" else server.grpc_url
    client = module.InferenceServerClient(url)
    client.module = module
    yield client
    client.close()


def _input(module, name, array, dtype):
    tensor = module.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_live_ready_and_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    for model in MODELS:
        assert client.is_model_ready(model)
    metadata = client.get_server_metadata()
    extensions = metadata["extensions"] if isinstance(metadata, dict) else metadata.extensions
    assert "model_repository" in extensions


def test_model_metadata_and_config(client):
    metadata = client.get_model_metadata("add_sub", "2")
    if isinstance(metadata, dict):
        names = [i["name"] for i in metadata["inputs"]]
        config = client.get_model_config("torch_linear")
        max_batch, params = config["max_batch_size"], config["parameters"]
    else:
        names = [i.name for i in metadata.inputs]
        config = client.get_model_config("torch_linear").config
        max_batch, params = config.max_batch_size, config.parameters
    assert names == ["INPUT0", "INPUT1"]
    assert max_batch == 32
    platform = params["strata_platform"]
    assert (
        platform["string_value"] if isinstance(platform, dict) else platform.string_value
    ) == "pytorch_libtorch"


def test_infer_fp32_both_versions_batched(client):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.ones((3, 4), dtype=np.float32)
    m = client.module
    for version, scale in (("1", 1), ("2", 2)):
        result = client.infer(
            "add_sub", [_input(m, "INPUT0", a, "FP32"), _input(m, "INPUT1", b, "FP32")], model_version=version
        )
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), (a + b) * scale)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), (a - b) * scale)


def test_infer_bytes(client):
    text = np.array([["héllo wörld"], ["strata"]], dtype=object)
    result = client.infer("string_upper", [_input(client.module, "TEXT", text, "BYTES")])
    assert [row[0].decode() for row in result.as_numpy("UPPER")] == ["HÉLLO WÖRLD", "STRATA"]


def test_infer_torchscript(client):
    x = np.array([[1, 2, 3, 4], [0, 0, 0, 1]], dtype=np.float32)
    weight = np.array([[j / 10 + i for j in range(4)] for i in range(2)], dtype=np.float32)
    result = client.infer("torch_linear", [_input(client.module, "INPUT__0", x, "FP32")])
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), x @ weight.T + [0.5, -0.5], rtol=1e-6)


@pytest.mark.parametrize(
    "name, dtype, shape",
    [("WRONG", "FP32", (1, 4)), ("INPUT__0", "INT32", (1, 4)), ("INPUT__0", "FP32", (1, 5))],
    ids=["name", "dtype", "shape"],
)
def test_bad_input_is_rejected_naming_the_tensor(client, name, dtype, shape):
    array = np.zeros(shape, dtype=np.int32 if dtype == "INT32" else np.float32)
    with pytest.raises(InferenceServerException) as raised:
        client.infer("torch_linear", [_input(client.module, name, array, dtype)])
    assert name in raised.value.message()
    if client.module is httpclient:
        assert raised.value.status() == "400"
    assert client.is_model_ready("torch_linear")


def test_repository_index_lists_every_model(client):
    index = client.get_model_repository_index()
    rows = (
        index
        if isinstance(index, list)
        else [{"name": m.name, "version": m.version, "state": m.state} for m in index.models]
    )
    states = {(r["name"], r["version"]): r["state"] for r in rows}
    assert states == {
        ("add_sub", "1"): "READY",
        ("add_sub", "2"): "READY",
        ("string_upper", "1"): "READY",
        ("torch_linear", "1"): "READY",
    }


def test_triton_metrics_per_model_and_version(server):
    client = httpclient.InferenceServerClient(server.http_url)
    a = np.ones((1, 4), dtype=np.float32)
    client.infer(
        "add_sub",
        [_input(httpclient, "INPUT0", a, "FP32"), _input(httpclient, "INPUT1", a, "FP32")],
        model_version="2",
    )
    client.close()
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    )
    lines = [line for line in text.splitlines() if line.startswith("nv_inference_request_success")]
    counts = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in lines}
    assert counts['model="add_sub",version="2"'] >= 1
    assert 'model="torch_linear",version="1"' in counts
    assert "nv_inference_queue_duration_us" in text
    # Strata's own series on the same port (server/metrics_endpoint.py), as one exposition
    assert "\nkvbm_index_blocks 0.0\n" in text and "# TYPE strata_router_decisions_total counter" in text
