"""Runs inside Triton's Python backend: serves an ONNX model with onnxruntime's CPU provider, as Triton's own
onnxruntime backend would (which ships in NVIDIA's containers only, not in PyTriton's Triton).

- Parameters that backend reads: `intra_op_thread_count`, `inter_op_thread_count`, `execution_mode` (1:
  parallel), `enable_mem_arena`, `enable_mem_pattern`, and `optimization { graph { level } }` (-1 basic, 1
  extended, 2 none, else all). With no `intra_op_thread_count`, each instance gets the cores this process may
  run on divided by the model's instance count (at least 1), so `instance_group` count x threads never
  oversubscribes the cores.
- Auto-complete (unless tritonserver runs with --disable-auto-complete-config): inputs and outputs the config
  does not declare come from the model; a model whose every tensor has a dynamic first dimension, in a config
  that declares no tensors and no max_batch_size, gets max_batch_size 4 (the backend's default-max-batch-size)
  and the dynamic batcher.
- Requests of one dynamic batch run as one session call, concatenated on the batch axis; inputs reach
  onnxruntime as views of Triton's tensors (no copy) except strings, which ONNX holds as text.
"""

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

DEFAULT_MAX_BATCH_SIZE = 4
MODEL_FILE = "strata_model.onnx"  # the link Strata stages to the operator's ONNX file (backends/onnx.py)
_LEVELS = {
    -1: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    1: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    2: ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}
_TRITON_TYPES = {
    "tensor(bool)": "TYPE_BOOL",
    "tensor(uint8)": "TYPE_UINT8",
    "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32",
    "tensor(uint64)": "TYPE_UINT64",
    "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16",
    "tensor(int32)": "TYPE_INT32",
    "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16",
    "tensor(float)": "TYPE_FP32",
    "tensor(double)": "TYPE_FP64",
    "tensor(string)": "TYPE_STRING",
}


def _parameters(config):
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def _session_options(config, parameters):
    options = ort.SessionOptions()
    instances = sum(int(group.get("count", 1) or 1) for group in config.get("instance_group", [])) or 1
    intra = parameters.get("intra_op_thread_count")
    options.intra_op_num_threads = (
        int(intra) if intra is not None else max(1, len(os.sched_getaffinity(0)) // instances)
    )
    if "inter_op_thread_count" in parameters:
        options.inter_op_num_threads = int(parameters["inter_op_thread_count"])
    if parameters.get("execution_mode") == "1":
        options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    if "enable_mem_arena" in parameters:
        options.enable_cpu_mem_arena = parameters["enable_mem_arena"] in ("1", "true")
    if "enable_mem_pattern" in parameters:
        options.enable_mem_pattern = parameters["enable_mem_pattern"] in ("1", "true")
    level = int(config.get("optimization", {}).get("graph", {}).get("level", 0) or 0)
    options.graph_optimization_level = _LEVELS.get(level, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    return options


def _dims(shape, batched):
    dims = [d if isinstance(d, int) and d >= 0 else -1 for d in shape]
    return dims[1:] if batched else dims


def _tensor_config(tensor, batched):
    data_type = _TRITON_TYPES.get(tensor.type)
    if data_type is None:
        raise pb_utils.TritonModelException(f"{tensor.name}: ONNX type {tensor.type} has no Triton type")
    return {"name": tensor.name, "data_type": data_type, "dims": _dims(tensor.shape, batched)}


def _to_onnx(array, onnx_type):
    if onnx_type == "tensor(string)":  # Triton's BYTES elements are bytes; ONNX strings are text
        return np.char.decode(array.astype(np.bytes_), "utf-8")
    return array


def _to_triton(array):
    if array.dtype.kind in ("U", "O"):
        return np.char.encode(array.astype(np.str_), "utf-8").astype(np.object_)
    return array


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config.as_dict()
        source = str(
            Path(__file__).parent / MODEL_FILE
        )  # __file__: the model.py link in a staged version folder
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        inputs, outputs = session.get_inputs(), session.get_outputs()
        sequence = config.get("sequence_batching") or {}
        implicit = {c["name"] for c in sequence.get("control_input", [])}
        states = json.loads(_parameters(config).get("strata_sequence_state", "[]"))  # the runner's own state
        implicit |= {s["input_name"] for s in states} | {s["output_name"] for s in states}
        batched = int(config.get("max_batch_size", 0)) > 0
        declared = config.get("input") or config.get("output")
        dynamic_first = all(t.shape and not isinstance(t.shape[0], int) for t in [*inputs, *outputs])
        if not batched and not declared and dynamic_first:
            auto_complete_model_config.set_max_batch_size(DEFAULT_MAX_BATCH_SIZE)
            if not sequence and not config.get("dynamic_batching"):
                auto_complete_model_config.set_dynamic_batching()
            batched = True
        have_inputs = {t["name"] for t in config.get("input", [])}
        have_outputs = {t["name"] for t in config.get("output", [])}
        for tensor in inputs:
            if tensor.name not in have_inputs and tensor.name not in implicit:
                auto_complete_model_config.add_input(_tensor_config(tensor, batched))
        for tensor in outputs:
            if tensor.name not in have_outputs and tensor.name not in implicit:
                auto_complete_model_config.add_output(_tensor_config(tensor, batched))
        return auto_complete_model_config

    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = _parameters(config)
        path = Path(args["model_repository"]) / args["model_version"] / MODEL_FILE
        self.session = ort.InferenceSession(
            str(path), _session_options(config, parameters), providers=["CPUExecutionProvider"]
        )
        self.inputs = [(t.name, t.type) for t in self.session.get_inputs()]
        self.outputs = [t["name"] for t in config["output"]]
        self.batched = int(config.get("max_batch_size", 0)) > 0
        self.states = SequenceStates(json.loads(parameters.get("strata_sequence_state", "[]")))
        self.fetch = self.outputs + self.states.output_names

    def execute(self, requests):
        feeds = [self._feed(request) for request in requests]
        together = self._run_together(feeds) if self.batched and len(requests) > 1 else None
        responses = []
        for i, (request, feed) in enumerate(zip(requests, feeds, strict=True)):
            try:
                results = together[i] if together is not None else self.session.run(self.fetch, feed)
            except Exception as exc:  # noqa: BLE001 - a bad request must not take the model down
                responses.append(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(f"onnxruntime: {exc}"))
                )
                continue
            self.states.keep(request, results[len(self.outputs) :])
            responses.append(self._response(results[: len(self.outputs)]))
        return responses

    def _feed(self, request):
        feed = {}
        for name, onnx_type in self.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                feed[name] = _to_onnx(tensor.as_numpy(), onnx_type)
        feed.update(self.states.current(request))
        return feed

    def _run_together(self, feeds):
        """One session call for the requests of a dynamic batch, split back per request; None if their shapes do
        not stack or the call fails (each then runs alone, so one bad request fails alone)."""
        try:
            sizes = [next(iter(feed.values())).shape[0] for feed in feeds]
            batch = {name: np.concatenate([feed[name] for feed in feeds]) for name in feeds[0]}
            results = self.session.run(self.fetch, batch)
        except Exception:  # noqa: BLE001 - see the docstring
            return None
        splits = np.cumsum(sizes)[:-1]
        per_output = [np.split(result, splits) for result in results]
        return [[parts[i] for parts in per_output] for i in range(len(feeds))]

    def _response(self, results):
        tensors = [
            pb_utils.Tensor(name, _to_triton(r)) for name, r in zip(self.outputs, results, strict=True)
        ]
        return pb_utils.InferenceResponse(tensors)


class SequenceStates:
    """Implicit state (`sequence_batching.state`) for a backend that has none (Triton's Python backend): each
    sequence's state tensors, by correlation id, fed to the model's state inputs and replaced by its state outputs
    after every request; zeros (`initial_state { zero_data: true }`) at a sequence's start; dropped at its end.
    Strata moves the config's `state` block into the parameter `strata_sequence_state` (backends/onnx.py)."""

    def __init__(self, states):
        self.states = states
        self.output_names = [state["output_name"] for state in states]
        self.held = {}  # correlation id -> {state input name: array}

    def current(self, request):
        if not self.states:
            return {}
        held = None if _starts(request) else self.held.get(request.correlation_id())
        return held if held is not None else {s["input_name"]: _zeros(s) for s in self.states}

    def keep(self, request, results):
        if not self.states:
            return
        sequence = request.correlation_id()
        if _ends(request):
            self.held.pop(sequence, None)
        else:
            names = [state["input_name"] for state in self.states]
            self.held[sequence] = dict(zip(names, results, strict=True))


def _zeros(state):
    dtype = pb_utils.triton_string_to_numpy(state["data_type"])
    return np.zeros([1, *state["dims"]], dtype=dtype)


def _starts(request):
    return bool(request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)


def _ends(request):
    return bool(request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
