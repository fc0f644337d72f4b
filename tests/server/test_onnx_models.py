"""A Triton repository of ONNX models, an auto-completed Python model and an ensemble, through real Triton and
tritonclient over HTTP and gRPC: the quickstart's models (add/sub in INT32 and INT8, strings, sequences under the
direct and oldest strategies), implicit state, system shared memory, auto-complete, dynamic batching, the
response cache, the rate limiter, warmup failures and the index's reasons. The models are built here with
onnx.helper, equivalent to Triton's quickstart ones."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from harness.servers import start_strata
from harness.waiting import wait_for

INT32, INT8, INT64, UINT64, STRING, FP32 = (
    TensorProto.INT32,
    TensorProto.INT8,
    TensorProto.INT64,
    TensorProto.UINT64,
    TensorProto.STRING,
    TensorProto.FLOAT,
)


def save_model(path: Path, nodes, inputs, outputs) -> None:
    """An ONNX file of `nodes`; inputs and outputs are (name, element type, shape) with None for a dynamic dim."""
    graph = helper.make_graph(
        nodes,
        path.parent.parent.name,
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def add_sub_model(path: Path, element: int, width: int = 16) -> None:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 (computed in INT32, as the quickstart's models)."""
    cast = element != INT32
    nodes = []
    for name in ("INPUT0", "INPUT1"):
        nodes.append(
            helper.make_node("Cast" if cast else "Identity", [name], [f"_{name}"], **_to(INT32, cast))
        )
    nodes.append(helper.make_node("Add", ["_INPUT0", "_INPUT1"], ["SUM"]))
    nodes.append(helper.make_node("Sub", ["_INPUT0", "_INPUT1"], ["DIFF"]))
    nodes.append(helper.make_node("Cast", ["SUM"], ["OUTPUT0"], to=element))
    nodes.append(helper.make_node("Cast", ["DIFF"], ["OUTPUT1"], to=element))
    tensors = [(n, element, [None, width]) for n in ("INPUT0", "INPUT1")]
    save_model(path, nodes, tensors, [(n, element, [None, width]) for n in ("OUTPUT0", "OUTPUT1")])


def _to(element: int, cast: bool) -> dict:
    return {"to": element} if cast else {}


def accumulator_model(path: Path, with_end: bool) -> None:
    """A stateful sequence model: ACC = STATE_IN + INPUT (implicit state), OUTPUT = ACC + 1000 * START, plus
    END * CORRID when `with_end`; READY must be 1 for the output to count."""
    nodes = [
        helper.make_node("Add", ["STATE_IN", "INPUT"], ["STATE_OUT"]),
        helper.make_node("Constant", [], ["THOUSAND"], value=helper.make_tensor("k", INT32, [], [1000])),
        helper.make_node("Mul", ["START", "THOUSAND"], ["STARTED"]),
        helper.make_node("Add", ["STATE_OUT", "STARTED"], ["WITH_START"]),
    ]
    inputs = [(n, INT32, [None, 1]) for n in ("INPUT", "START", "READY", "STATE_IN")]
    last = "WITH_START"
    if with_end:
        nodes += [
            helper.make_node("Cast", ["CORRID"], ["CORRID32"], to=INT32),
            helper.make_node("Mul", ["END", "CORRID32"], ["ENDED"]),
            helper.make_node("Add", ["WITH_START", "ENDED"], ["WITH_END"]),
        ]
        inputs += [("END", INT32, [None, 1]), ("CORRID", UINT64, [None, 1])]
        last = "WITH_END"
    nodes.append(helper.make_node("Mul", [last, "READY"], ["OUTPUT"]))
    save_model(path, nodes, inputs, [("OUTPUT", INT32, [None, 1]), ("STATE_OUT", INT32, [None, 1])])


def scale_model(path: Path, factor: int) -> None:
    """OUTPUT = INPUT * factor (FP32, dims [-1, 4])."""
    nodes = [
        helper.make_node(
            "Constant", [], ["FACTOR"], value=helper.make_tensor("f", FP32, [], [float(factor)])
        ),
        helper.make_node("Mul", ["INPUT", "FACTOR"], ["OUTPUT"]),
    ]
    save_model(path, nodes, [("INPUT", FP32, [None, 4])], [("OUTPUT", FP32, [None, 4])])


def reshape_model(path: Path) -> None:
    """OUTPUT = INPUT reshaped to [-1, 4]: fails on a row of any other width (the warmup below sends 3)."""
    nodes = [
        helper.make_node("Constant", [], ["SHAPE"], value=helper.make_tensor("s", INT64, [2], [-1, 4])),
        helper.make_node("Reshape", ["INPUT", "SHAPE"], ["OUTPUT"]),
    ]
    save_model(path, nodes, [("INPUT", FP32, [None, None])], [("OUTPUT", FP32, [None, 4])])


def openvino_model(path: Path, onnx_file: Path) -> None:
    """The ONNX model converted to OpenVINO's IR (model.xml + model.bin) by openvino itself."""
    import openvino as ov

    path.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(ov.convert_model(str(onnx_file)), str(path))


def add_sub_config(name: str, data_type: str, extra: str = "", width: int = 16) -> str:
    tensors = ",".join(
        f'{{ name: "{n}" data_type: {data_type} dims: [ {width} ] }}' for n in ("INPUT0", "INPUT1")
    )
    outputs = ",".join(
        f'{{ name: "{n}" data_type: {data_type} dims: [ {width} ] }}' for n in ("OUTPUT0", "OUTPUT1")
    )
    return (
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        f"input [ {tensors} ]\noutput [ {outputs} ]\n{extra}"
    )


def sequence_config(name: str, strategy: str, with_end: bool) -> str:
    controls = [("START", "CONTROL_SEQUENCE_START"), ("READY", "CONTROL_SEQUENCE_READY")]
    if with_end:
        controls.append(("END", "CONTROL_SEQUENCE_END"))
    blocks = [
        f'{{ name: "{n}" control [ {{ kind: {kind} int32_false_true: [ 0, 1 ] }} ] }}' for n, kind in controls
    ]
    if with_end:
        blocks.append(
            '{ name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }'
        )
    state = (
        'state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ 1 ] '
        'initial_state { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "zero" } } ]'
    )
    return (
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        f"sequence_batching {{ {strategy} control_input [ {', '.join(blocks)} ] {state} }}\n"
        'input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
    )


AUTO_COMPLETE_PYTHON = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.set_max_batch_size(4)
        config.add_input({"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]})
        config.add_output({"name": "LENGTH", "data_type": "TYPE_INT32", "dims": [1]})
        return config

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            lengths = np.vectorize(len, otypes=[np.int32])(text)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("LENGTH", lengths)]))
        return responses
"""

PLUS_ONE_PYTHON = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT", pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy() + 1)]
            )
            for r in requests
        ]
"""

FP32_IO = (
    'input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    'output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
)

# INPUT -> scale v1 (x1) -> plus_one (Python) -> scale v2 (x2) -> OUTPUT
CHAIN_ENSEMBLE = (
    'name: "chain"\nplatform: "ensemble"\nmax_batch_size: 8\n'
    + FP32_IO
    + """ensemble_scheduling { step [
  { model_name: "scale" model_version: 1 input_map { key: "INPUT" value: "INPUT" }
    output_map { key: "OUTPUT" value: "scaled" } },
  { model_name: "plus_one" model_version: -1 input_map { key: "INPUT" value: "scaled" }
    output_map { key: "OUTPUT" value: "plus" } },
  { model_name: "scale" model_version: 2 input_map { key: "INPUT" value: "plus" }
    output_map { key: "OUTPUT" value: "OUTPUT" } }
] }
"""
)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# a warmup that passes (the model loads): two batches of zeros
WARMUP_ZEROS = """model_warmup [ { name: "zeros" batch_size: 2 count: 2
  inputs { key: "INPUT0" value: { data_type: TYPE_INT32 dims: [ 16 ] zero_data: true } }
  inputs { key: "INPUT1" value: { data_type: TYPE_INT32 dims: [ 16 ] zero_data: true } } } ]
"""


def build_repository(root: Path) -> Path:
    repo = root / "repo"
    add_sub_model(repo / "simple" / "1" / "model.onnx", INT32)
    write(repo / "simple" / "config.pbtxt", add_sub_config("simple", "TYPE_INT32"))
    add_sub_model(repo / "simple_int8" / "1" / "model.onnx", INT8)
    write(repo / "simple_int8" / "config.pbtxt", add_sub_config("simple_int8", "TYPE_INT8"))
    add_sub_model(repo / "simple_string" / "1" / "model.onnx", STRING)
    write(repo / "simple_string" / "config.pbtxt", add_sub_config("simple_string", "TYPE_STRING"))
    batching = "dynamic_batching { max_queue_delay_microseconds: 300000 }\n" + WARMUP_ZEROS
    add_sub_model(repo / "batched" / "1" / "model.onnx", INT32)
    write(repo / "batched" / "config.pbtxt", add_sub_config("batched", "TYPE_INT32", batching))
    add_sub_model(repo / "cached" / "1" / "model.onnx", INT32)
    write(
        repo / "cached" / "config.pbtxt",
        add_sub_config("cached", "TYPE_INT32", "response_cache { enable: true }"),
    )
    accumulator_model(repo / "seq_direct" / "1" / "model.onnx", with_end=False)
    write(repo / "seq_direct" / "config.pbtxt", sequence_config("seq_direct", "direct { }", with_end=False))
    accumulator_model(repo / "seq_oldest" / "1" / "model.onnx", with_end=True)
    oldest = "oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 10000 }"
    write(repo / "seq_oldest" / "config.pbtxt", sequence_config("seq_oldest", oldest, with_end=True))

    add_sub_model(repo / "auto_onnx" / "1" / "model.onnx", INT32, width=4)  # no config.pbtxt at all
    add_sub_model(repo / "partial_onnx" / "1" / "model.onnx", INT32, width=4)
    write(repo / "partial_onnx" / "config.pbtxt", 'platform: "onnxruntime_onnx"\nmax_batch_size: 2\n')
    write(repo / "auto_python" / "1" / "model.py", AUTO_COMPLETE_PYTHON)  # no config.pbtxt at all

    ensemble_repository(root)  # scale, plus_one and chain, into the same repo
    missing_step = CHAIN_ENSEMBLE.replace('"chain"', '"broken_chain"').replace(
        '"plus_one"', '"no_such_model"'
    )
    write(repo / "broken_chain" / "config.pbtxt", missing_step)
    (repo / "broken_chain" / "1").mkdir()

    openvino_model(repo / "ov_add_sub" / "1" / "model.xml", repo / "simple" / "1" / "model.onnx")
    ov_config = add_sub_config("ov_add_sub", "TYPE_INT32").replace(
        'platform: "onnxruntime_onnx"', 'backend: "openvino"'
    )
    write(
        repo / "ov_add_sub" / "config.pbtxt",
        ov_config + 'parameters { key: "NUM_STREAMS" value: { string_value: "1" } }\n',
    )
    openvino_model(repo / "ov_auto" / "1" / "model.xml", repo / "auto_onnx" / "1" / "model.onnx")  # no config

    reshape_model(repo / "warm_fail" / "1" / "model.onnx")
    warmup = 'model_warmup [ { name: "narrow" batch_size: 1 inputs { key: "INPUT" value: { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } } } ]'
    write(
        repo / "warm_fail" / "config.pbtxt",
        'name: "warm_fail"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n' + warmup,
    )
    add_sub_model(repo / "wrong_model" / "1" / "model.onnx", INT32)
    write(repo / "wrong_model" / "config.pbtxt", add_sub_config("some_other_name", "TYPE_INT32"))
    write(repo / "plan_model" / "config.pbtxt", 'platform: "tensorrt_plan"\nmax_batch_size: 8\n')
    (repo / "plan_model" / "1").mkdir()
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("onnx")
    process = start_strata(build_repository(tmp), tmp, "--cache-config", "local,size=1048576")
    yield process
    process.stop()


@pytest.fixture(params=["http", "grpc"])
def client(request, server):
    module = httpclient if request.param == "http" else grpcclient
    client = module.InferenceServerClient(server.http_url if request.param == "http" else server.grpc_url)
    client.module = module
    yield client
    client.close()


def tensor(module, name: str, array: np.ndarray, datatype: str):
    t = module.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def add_sub(client, model: str, a: np.ndarray, b: np.ndarray, datatype: str):
    m = client.module
    result = client.infer(model, [tensor(m, "INPUT0", a, datatype), tensor(m, "INPUT1", b, datatype)])
    return result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1")


def index(server) -> dict[str, dict]:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        return {row["name"]: row for row in client.get_model_repository_index()}
    finally:
        client.close()


@pytest.mark.parametrize(
    "dtype,datatype,model", [(np.int32, "INT32", "simple"), (np.int8, "INT8", "simple_int8")]
)
def test_add_sub(client, dtype, datatype, model):
    a = np.arange(32, dtype=dtype).reshape(2, 16)
    b = np.full((2, 16), 3, dtype=dtype)
    total, difference = add_sub(client, model, a, b, datatype)
    assert total.dtype == dtype and difference.dtype == dtype
    np.testing.assert_array_equal(total, a + b)
    np.testing.assert_array_equal(difference, a - b)


@pytest.mark.parametrize("model", ["ov_add_sub", "ov_auto"])
def test_openvino(server, client, model):
    width = 16 if model == "ov_add_sub" else 4
    a = np.arange(2 * width, dtype=np.int32).reshape(2, width)
    total, difference = add_sub(client, model, a, a + 1, "INT32")
    np.testing.assert_array_equal(total, 2 * a + 1)
    np.testing.assert_array_equal(difference, -np.ones_like(a))
    if model == "ov_auto":  # completed from model.xml, as ONNX models are from model.onnx
        assert [(t["name"], t["dims"]) for t in config_of(server, model)["input"]] == [
            ("INPUT0", [4]),
            ("INPUT1", [4]),
        ]


def test_strings(client):
    a = np.array([[str(i).encode() for i in range(16)]], dtype=np.object_)
    b = np.array([[b"1"] * 16], dtype=np.object_)
    total, difference = add_sub(client, "simple_string", a, b, "BYTES")
    assert [int(x) for x in total[0]] == [i + 1 for i in range(16)]
    assert [int(x) for x in difference[0]] == [i - 1 for i in range(16)]


def test_a_bad_request_fails_alone_and_the_model_keeps_serving(client):
    a = np.array([[b"not a number"] * 16], dtype=np.object_)
    with pytest.raises(InferenceServerException, match="onnxruntime"):
        add_sub(client, "simple_string", a, a, "BYTES")
    ones = np.ones((1, 16), dtype=np.int32)
    np.testing.assert_array_equal(add_sub(client, "simple", ones, ones, "INT32")[0], 2 * ones)


def run_sequences(client, model: str, sequences: dict[int, list[int]]) -> dict[int, list[int]]:
    """Send the sequences' requests interleaved (one of each in turn), each with its id, start and end flags."""
    outputs: dict[int, list[int]] = {sequence: [] for sequence in sequences}
    for step in range(max(map(len, sequences.values()))):
        for sequence, values in sequences.items():
            if step >= len(values):
                continue
            value = np.array([[values[step]]], dtype=np.int32)
            result = client.infer(
                model,
                [tensor(client.module, "INPUT", value, "INT32")],
                sequence_id=sequence,
                sequence_start=step == 0,
                sequence_end=step == len(values) - 1,
            )
            outputs[sequence].append(int(result.as_numpy("OUTPUT")[0][0]))
    return outputs


def test_sequence_direct_keeps_each_sequences_state(client):
    outputs = run_sequences(client, "seq_direct", {11: [1, 2, 3], 12: [10, 20]})
    # running sums, with 1000 added where START was set
    assert outputs == {11: [1001, 3, 6], 12: [1010, 30]}
    # a sequence that starts again starts from zero state
    assert run_sequences(client, "seq_direct", {11: [5, 5]}) == {11: [1005, 10]}


def test_sequence_oldest_with_end_and_correlation_id(client):
    outputs = run_sequences(client, "seq_oldest", {21: [1, 2, 3], 22: [4, 5]})
    # END x CORRID is added on each sequence's last request
    assert outputs == {21: [1001, 3, 6 + 21], 22: [1004, 9 + 22]}


def test_system_shared_memory_in_and_out(client):
    m = client.module
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)
    size = a.nbytes
    prefix = f"/strata_test_{m.__name__.split('.')[-1]}"
    inputs_region = shm.create_shared_memory_region("in", prefix + "_in", 2 * size)
    outputs_region = shm.create_shared_memory_region("out", prefix + "_out", 2 * size)
    try:
        shm.set_shared_memory_region(inputs_region, [a, b])
        client.register_system_shared_memory("in", prefix + "_in", 2 * size)
        client.register_system_shared_memory("out", prefix + "_out", 2 * size)
        inputs = [m.InferInput("INPUT0", [1, 16], "INT32"), m.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("in", size)
        inputs[1].set_shared_memory("in", size, offset=size)
        outputs = [m.InferRequestedOutput("OUTPUT0"), m.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("out", size)
        outputs[1].set_shared_memory("out", size, offset=size)
        client.infer("simple", inputs, outputs=outputs)
        total = shm.get_contents_as_numpy(outputs_region, np.int32, [1, 16])
        difference = shm.get_contents_as_numpy(outputs_region, np.int32, [1, 16], offset=size)
        np.testing.assert_array_equal(total, a + b)
        np.testing.assert_array_equal(difference, a - b)
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(inputs_region)
        shm.destroy_shared_memory_region(outputs_region)


def config_of(server, model: str) -> dict:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        return client.get_model_config(model)
    finally:
        client.close()


def test_auto_complete_onnx_without_config(server, client):
    config = config_of(server, "auto_onnx")
    assert config["max_batch_size"] == 4 and "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("INPUT0", "TYPE_INT32", [4]),
        ("INPUT1", "TYPE_INT32", [4]),
    ]
    assert [t["name"] for t in config["output"]] == ["OUTPUT0", "OUTPUT1"]
    a = np.arange(8, dtype=np.int32).reshape(2, 4)
    np.testing.assert_array_equal(add_sub(client, "auto_onnx", a, a, "INT32")[0], 2 * a)


def test_auto_complete_fills_a_partial_config(server, client):
    config = config_of(server, "partial_onnx")
    assert config["max_batch_size"] == 2  # the operator's value stays
    assert [(t["name"], t["dims"]) for t in config["input"]] == [("INPUT0", [4]), ("INPUT1", [4])]
    a = np.ones((2, 4), dtype=np.int32)
    np.testing.assert_array_equal(add_sub(client, "partial_onnx", a, a, "INT32")[1], 0 * a)


def test_auto_complete_python_model_without_config(server, client):
    config = config_of(server, "auto_python")
    assert config["backend"] == "python" and config["max_batch_size"] == 4
    text = np.array([[b"hello"], [b"strata!"]], dtype=np.object_)
    result = client.infer("auto_python", [tensor(client.module, "TEXT", text, "BYTES")])
    assert result.as_numpy("LENGTH").tolist() == [[5], [7]]


def test_ensemble_of_onnx_and_python_steps_across_two_versions(client):
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    result = client.infer("chain", [tensor(client.module, "INPUT", x, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT"), (x * 1 + 1) * 2)


def inference_stats(server, model: str) -> dict:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        return client.get_inference_statistics(model)["model_stats"][0]
    finally:
        client.close()


def test_dynamic_batcher_runs_concurrent_requests_together(server):
    """Eight concurrent requests within the batcher's 300 ms queue delay run in fewer executions than eight."""
    before = inference_stats(server, "batched")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [tensor(grpcclient, "INPUT0", a, "INT32"), tensor(grpcclient, "INPUT1", a, "INT32")]
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: client.infer("batched", inputs).as_numpy("OUTPUT0"), range(8)))
    finally:
        client.close()
    for total in results:
        np.testing.assert_array_equal(total, 2 * a)
    after = inference_stats(server, "batched")
    inferences = after["inference_count"] - before.get("inference_count", 0)
    executions = after["execution_count"] - before.get("execution_count", 0)
    assert inferences == 8 and executions < 8, (inferences, executions)


def test_response_cache_answers_a_repeated_request(server, client):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    first = add_sub(client, "cached", a, a, "INT32")
    hits = inference_stats(server, "cached")["inference_stats"]["cache_hit"]["count"]
    second = add_sub(client, "cached", a, a, "INT32")
    np.testing.assert_array_equal(first[0], second[0])
    assert inference_stats(server, "cached")["inference_stats"]["cache_hit"]["count"] == hits + 1


def test_rate_limiter_serves_within_its_resources_and_refuses_beyond(tmp_path):
    """A server of its own: Triton 2.51 with the rate limiter on has crashed (SIGSEGV) while another model's
    failed warmup removed its instance from the limiter, so no model here fails a warmup."""
    repo = tmp_path / "repo"
    limited = 'instance_group [ { count: 1 kind: KIND_CPU rate_limiter { resources [ { name: "R1" count: 2 } ] } } ]'
    add_sub_model(repo / "limited" / "1" / "model.onnx", INT32)
    write(repo / "limited" / "config.pbtxt", add_sub_config("limited", "TYPE_INT32", limited))
    greedy = limited.replace("count: 2", "count: 9")
    add_sub_model(repo / "over_limit" / "1" / "model.onnx", INT32)
    write(repo / "over_limit" / "config.pbtxt", add_sub_config("over_limit", "TYPE_INT32", greedy))

    server = start_strata(repo, tmp_path, "--rate-limit", "execution_count", "--rate-limit-resource", "R1:4")
    client = httpclient.InferenceServerClient(server.http_url)
    client.module = httpclient
    try:
        a = np.ones((1, 16), dtype=np.int32)
        np.testing.assert_array_equal(add_sub(client, "limited", a, a, "INT32")[0], 2 * a)
        row = index(server)["over_limit"]
        assert row["state"] == "UNAVAILABLE" and "the minimum required count is 9" in row["reason"], row
    finally:
        client.close()
        server.stop()


def test_index_gives_the_reasons(server):
    rows = index(server)
    assert rows["wrong_model"]["state"] == "UNAVAILABLE"
    assert (
        'name "some_other_name" does not match the model folder "wrong_model"'
        in rows["wrong_model"]["reason"]
    )
    assert rows["warm_fail"]["state"] == "UNAVAILABLE"
    assert "warm" in rows["warm_fail"]["reason"] and "onnxruntime" in rows["warm_fail"]["reason"]
    assert (
        rows["broken_chain"]["state"] == "UNAVAILABLE" and "no_such_model" in rows["broken_chain"]["reason"]
    )
    assert "GPU" in rows["plan_model"]["reason"]
    for ready in ("simple", "chain", "scale", "auto_onnx", "auto_python", "seq_oldest"):
        assert rows[ready]["state"] == "READY", rows[ready]


def test_runner_config_keeps_the_operators_blocks(server):
    """What Triton loads keeps the operator's batching, sequence and instance blocks; the backend changes, and the
    state and warmup blocks move into parameters the runner reads."""
    config = config_of(server, "seq_oldest")
    assert config["backend"] == "python"
    assert config["parameters"]["strata_platform"]["string_value"] == "onnxruntime_onnx"
    assert config["sequence_batching"]["oldest"]["max_candidate_sequences"] == 4
    warmup = json.loads(config_of(server, "batched")["parameters"]["strata_warmup"]["string_value"])
    assert [(w["name"], w["batchSize"], w["count"]) for w in warmup] == [("zeros", 2, 2)]
    state = json.loads(config["parameters"]["strata_sequence_state"]["string_value"])
    assert state == [
        {"input_name": "STATE_IN", "output_name": "STATE_OUT", "data_type": "TYPE_INT32", "dims": [1]}
    ]


def ensemble_repository(root: Path) -> Path:
    """scale (ONNX, versions 1 and 2), plus_one (Python) and the ensemble chain of them."""
    repo = root / "repo"
    for version, factor in ((1, 1), (2, 2)):
        scale_model(repo / "scale" / str(version) / "model.onnx", factor)
    scale_config = (
        'name: "scale"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\nversion_policy: { all { } }\n'
    )
    write(repo / "scale" / "config.pbtxt", scale_config + FP32_IO)
    write_plus_one(repo)
    write(repo / "chain" / "config.pbtxt", CHAIN_ENSEMBLE)
    (repo / "chain" / "1").mkdir()
    return repo


def write_plus_one(repo: Path, addend: int = 1) -> None:
    write(repo / "plus_one" / "1" / "model.py", PLUS_ONE_PYTHON.replace("+ 1", f"+ {addend}"))
    write(
        repo / "plus_one" / "config.pbtxt",
        'name: "plus_one"\nbackend: "python"\nmax_batch_size: 8\n' + FP32_IO,
    )


def chain_output(client) -> float | None:
    """chain's output for an input of ones (None while it has no version ready)."""
    x = np.ones((1, 4), dtype=np.float32)
    try:
        return float(client.infer("chain", [tensor(httpclient, "INPUT", x, "FP32")]).as_numpy("OUTPUT")[0, 0])
    except InferenceServerException:
        return None


def test_poll_mode_reloads_and_unloads_an_ensemble_with_its_step_models(tmp_path):
    repo = ensemble_repository(tmp_path)
    server = start_strata(repo, tmp_path, "--model-control-mode", "poll", "--repository-poll-secs", "0.5")
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        assert chain_output(client) == (1 + 1) * 2
        write_plus_one(repo, addend=10)  # an edited step model: the ensemble runs the new one
        wait_for(
            lambda: chain_output(client) == (1 + 10) * 2, 60, what="the ensemble through the reloaded step"
        )
        shutil.rmtree(repo / "plus_one")  # a removed step model: the ensemble is unavailable
        wait_for(lambda: chain_output(client) is None, 60, what="the ensemble unavailable without its step")
        assert {r["name"]: r.get("state") for r in client.get_model_repository_index()}[
            "chain"
        ] == "UNAVAILABLE"
        write_plus_one(repo)  # back: the ensemble serves again
        wait_for(lambda: chain_output(client) == (1 + 1) * 2, 60, what="the ensemble back with its step")
    finally:
        client.close()
        server.stop()
