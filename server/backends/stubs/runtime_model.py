"""Runs inside Triton's Python backend: serves an ONNX model (onnxruntime's CPU provider) or an OpenVINO IR model
(openvino's CPU plugin), as Triton's own onnxruntime and OpenVINO backends would; those ship in NVIDIA's containers
only, not in PyTriton's Triton. Strata stages the model file beside this runner as `strata_model.onnx` or
`strata_model.xml` (server/backends/onnx.py, openvino.py); which one is there picks the runtime.

- Parameters: onnxruntime's `intra_op_thread_count`, `inter_op_thread_count`, `execution_mode` (1: parallel),
  `enable_mem_arena`, `enable_mem_pattern`, `optimization { graph { level } }` (-1 basic, 1 extended, 2 none,
  else all); OpenVINO's `INFERENCE_NUM_THREADS`, `NUM_STREAMS`, `PERFORMANCE_HINT`. Without a thread count, each
  instance gets the cores this process may run on divided by the model's instance count (at least 1), so
  `instance_group` count x threads never oversubscribes the cores.
- Auto-complete (unless tritonserver runs with --disable-auto-complete-config): inputs and outputs the config
  does not declare come from the model; a model whose every tensor has a dynamic first dimension, in a config
  that declares no tensors and no max_batch_size, gets max_batch_size 4 (the backends' default-max-batch-size)
  and the dynamic batcher.
- Requests of one dynamic batch run as one call, concatenated on the batch axis; inputs reach the runtime as
  views of Triton's tensors (no copy) except strings, which ONNX holds as text.
- Implicit state (`sequence_batching.state`), which the Python backend lacks, is kept here (`SequenceStates`).
- `model_warmup` samples run here, in `initialize` (Strata moves them into the parameter `strata_warmup`): a
  failing one fails the load with Triton's message, without Triton 2.51's crash on a failed warmup.
"""

import json
import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

DEFAULT_MAX_BATCH_SIZE = 4
ONNX_FILE = "strata_model.onnx"  # the links Strata stages to the operator's model file
OPENVINO_FILE = "strata_model.xml"
OPENVINO_WEIGHTS = "strata_model.bin"


class Tensor:
    """A model input or output: name, Triton data type (TYPE_*), shape with None for a dynamic dimension."""

    def __init__(self, name, data_type, shape):
        self.name, self.data_type, self.shape = name, data_type, shape

    def config(self, batched):
        if self.data_type is None:
            raise pb_utils.TritonModelException(f"{self.name}: the model's data type has no Triton type")
        dims = [-1 if d is None else d for d in self.shape]
        return {"name": self.name, "data_type": self.data_type, "dims": dims[1:] if batched else dims}


class OnnxRuntime:
    """onnxruntime's CPU provider on an ONNX file."""

    NAME = "onnxruntime"

    TYPES = {
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

    def __init__(self, folder, config, threads):
        import onnxruntime as ort

        parameters = _parameters(config)
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(parameters.get("intra_op_thread_count", threads))
        if "inter_op_thread_count" in parameters:
            options.inter_op_num_threads = int(parameters["inter_op_thread_count"])
        if parameters.get("execution_mode") == "1":
            options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        if "enable_mem_arena" in parameters:
            options.enable_cpu_mem_arena = parameters["enable_mem_arena"] in ("1", "true")
        if "enable_mem_pattern" in parameters:
            options.enable_mem_pattern = parameters["enable_mem_pattern"] in ("1", "true")
        levels = {
            -1: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            1: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            2: ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        }
        level = int(config.get("optimization", {}).get("graph", {}).get("level", 0) or 0)
        options.graph_optimization_level = levels.get(level, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
        self.session = ort.InferenceSession(
            str(folder / ONNX_FILE), options, providers=["CPUExecutionProvider"]
        )
        self.inputs = [self._tensor(t) for t in self.session.get_inputs()]
        self.outputs = [self._tensor(t) for t in self.session.get_outputs()]

    def _tensor(self, port):
        shape = [d if isinstance(d, int) and d >= 0 else None for d in port.shape]
        return Tensor(port.name, self.TYPES.get(port.type), shape)

    def run(self, names, feed):
        strings = {t.name for t in self.inputs if t.data_type == "TYPE_STRING"}
        for name in strings & feed.keys():  # Triton's BYTES elements are bytes; ONNX strings are text
            feed[name] = np.char.decode(feed[name].astype(np.bytes_), "utf-8")
        return self.session.run(names, feed)


class OpenVINORuntime:
    """openvino's CPU plugin on an IR model (model.xml + its weights)."""

    NAME = "openvino"

    TYPES = {
        "boolean": "TYPE_BOOL",
        "u8": "TYPE_UINT8",
        "u16": "TYPE_UINT16",
        "u32": "TYPE_UINT32",
        "u64": "TYPE_UINT64",
        "i8": "TYPE_INT8",
        "i16": "TYPE_INT16",
        "i32": "TYPE_INT32",
        "i64": "TYPE_INT64",
        "f16": "TYPE_FP16",
        "f32": "TYPE_FP32",
        "f64": "TYPE_FP64",
    }

    def __init__(self, folder, config, threads):
        import openvino as ov

        parameters = _parameters(config)
        core = ov.Core()
        model = core.read_model(str(folder / OPENVINO_FILE), str(folder / OPENVINO_WEIGHTS))
        settings = {"INFERENCE_NUM_THREADS": int(parameters.get("INFERENCE_NUM_THREADS", threads))}
        for key in ("NUM_STREAMS", "PERFORMANCE_HINT"):
            if key in parameters:
                settings[key] = parameters[key]
        self.compiled = core.compile_model(model, "CPU", settings)
        self.inputs = [self._tensor(port) for port in model.inputs]
        self.outputs = [self._tensor(port) for port in model.outputs]

    def _tensor(self, port):
        shape = [d.get_length() if d.is_static else None for d in port.get_partial_shape()]
        return Tensor(port.get_any_name(), self.TYPES.get(port.get_element_type().get_type_name()), shape)

    def run(self, names, feed):
        results = self.compiled(feed)
        return [results[self.compiled.output(name)] for name in names]


def _parameters(config):
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def _open(folder, config):
    """The runtime for the model file staged in `folder`, with the threads each instance may use."""
    instances = sum(int(group.get("count", 1) or 1) for group in config.get("instance_group", [])) or 1
    threads = max(1, len(os.sched_getaffinity(0)) // instances)
    runtime = OpenVINORuntime if (folder / OPENVINO_FILE).exists() else OnnxRuntime
    return runtime(folder, config, threads)


def _to_triton(array):
    if array.dtype.kind in ("U", "O"):
        return np.char.encode(array.astype(np.str_), "utf-8").astype(np.object_)
    return array


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config.as_dict()
        runtime = _open(
            Path(__file__).parent, config
        )  # __file__: the model.py link in a staged version folder
        sequence = config.get("sequence_batching") or {}
        implicit = {c["name"] for c in sequence.get("control_input", [])}
        states = json.loads(_parameters(config).get("strata_sequence_state", "[]"))  # the runner's own state
        implicit |= {s["input_name"] for s in states} | {s["output_name"] for s in states}
        batched = int(config.get("max_batch_size", 0)) > 0
        declared = config.get("input") or config.get("output")
        tensors = [*runtime.inputs, *runtime.outputs]
        if not batched and not declared and all(t.shape and t.shape[0] is None for t in tensors):
            auto_complete_model_config.set_max_batch_size(DEFAULT_MAX_BATCH_SIZE)
            if not sequence and not config.get("dynamic_batching"):
                auto_complete_model_config.set_dynamic_batching()
            batched = True
        have_inputs = {t["name"] for t in config.get("input", [])} | implicit
        have_outputs = {t["name"] for t in config.get("output", [])} | implicit
        for tensor in runtime.inputs:
            if tensor.name not in have_inputs:
                auto_complete_model_config.add_input(tensor.config(batched))
        for tensor in runtime.outputs:
            if tensor.name not in have_outputs:
                auto_complete_model_config.add_output(tensor.config(batched))
        return auto_complete_model_config

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.runtime = _open(Path(args["model_repository"]) / args["model_version"], config)
        self.inputs = [t.name for t in self.runtime.inputs]
        self.outputs = [t["name"] for t in config["output"]]
        self.batched = int(config.get("max_batch_size", 0)) > 0
        self.states = SequenceStates(json.loads(_parameters(config).get("strata_sequence_state", "[]")))
        self.fetch = self.outputs + self.states.output_names
        for sample in json.loads(_parameters(config).get("strata_warmup", "[]")):
            self._warm_up(sample, Path(args["model_repository"]) / "warmup")

    def _warm_up(self, sample, folder):
        """Run one `model_warmup` sample `count` times; a failure fails the load with Triton's message."""
        batch = [int(sample.get("batchSize", 1))] if self.batched else []
        feed = {}
        for name, spec in sample.get("inputs", {}).items():
            shape = batch + [int(d) for d in spec.get("dims", [])]
            dtype = pb_utils.triton_string_to_numpy(spec["dataType"])
            if "inputDataFile" in spec:
                data = np.frombuffer((folder / spec["inputDataFile"]).read_bytes(), dtype=dtype)
                feed[name] = data.reshape(shape)
            elif spec.get("randomData"):
                feed[name] = np.random.default_rng(0).integers(0, 2, shape).astype(dtype)
            else:
                feed[name] = np.zeros(shape, dtype=np.bytes_ if dtype is np.object_ else dtype).astype(dtype)
        for _ in range(int(sample.get("count", 1) or 1)):
            try:
                self.runtime.run(self.fetch, {**feed, **self.states.initial()})
            except Exception as exc:  # noqa: BLE001 - reported as Triton reports a failed warmup
                message = (
                    f"failed to run warmup sample '{sample.get('name', '')}': {self.runtime.NAME}: {exc}"
                )
                raise pb_utils.TritonModelException(message) from None

    def execute(self, requests):
        feeds = [self._feed(request) for request in requests]
        together = self._run_together(feeds) if self.batched and len(requests) > 1 else None
        responses = []
        for i, (request, feed) in enumerate(zip(requests, feeds, strict=True)):
            try:
                results = together[i] if together is not None else self.runtime.run(self.fetch, feed)
            except Exception as exc:  # noqa: BLE001 - a bad request must not take the model down
                error = pb_utils.TritonError(f"{self.runtime.NAME}: {exc}")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            self.states.keep(request, results[len(self.outputs) :])
            responses.append(self._response(results[: len(self.outputs)]))
        return responses

    def _feed(self, request):
        feed = {}
        for name in self.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                feed[name] = tensor.as_numpy()
        feed.update(self.states.current(request))
        return feed

    def _run_together(self, feeds):
        """One call for the requests of a dynamic batch, split back per request; None if their shapes do not
        stack or the call fails (each then runs alone, so one bad request fails alone)."""
        try:
            sizes = [next(iter(feed.values())).shape[0] for feed in feeds]
            batch = {name: np.concatenate([feed[name] for feed in feeds]) for name in feeds[0]}
            results = self.runtime.run(self.fetch, batch)
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
        starts = _flagged(request, pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
        held = None if starts else self.held.get(request.correlation_id())
        return held if held is not None else self.initial()

    def initial(self):
        """Every state input at its initial value (zeros)."""
        return {s["input_name"]: _zeros(s) for s in self.states}

    def keep(self, request, results):
        if not self.states:
            return
        sequence = request.correlation_id()
        if _flagged(request, pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END):
            self.held.pop(sequence, None)
        else:
            names = [state["input_name"] for state in self.states]
            self.held[sequence] = dict(zip(names, results, strict=True))


def _zeros(state):
    dtype = pb_utils.triton_string_to_numpy(state["data_type"])
    return np.zeros([1, *state["dims"]], dtype=dtype)


def _flagged(request, flag):
    return bool(request.flags() & flag)
