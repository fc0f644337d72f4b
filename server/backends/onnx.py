"""ONNX models (`platform: "onnxruntime_onnx"` or `backend: "onnxruntime"`): `model.onnx`, or the file that
`default_model_filename` names, with any external-data files beside it.

The Triton bundled with PyTriton has no onnxruntime backend (it ships in NVIDIA's containers only), so Strata
serves ONNX through Triton's Python backend with a runner (`stubs/runtime_model.py`) that runs onnxruntime's CPU
provider in the backend's process, honouring the parameters Triton's onnxruntime backend reads and its
auto-complete. Triton's core still batches, sequences, warms up, caches and rate-limits these models: the staged
config keeps every block of the operator's. `stage` is all this backend adds to `staging.StagedBackend`.
"""

from __future__ import annotations

import json
from pathlib import Path

from google.protobuf import json_format
from tritonclient.grpc.model_config_pb2 import DataType

from server.backends.staging import runner_config, stage_with_runner
from server.repository.model_config import ModelConfig
from server.repository.scan import ModelSource

RUNNER = Path(__file__).parent / "stubs" / "runtime_model.py"
MODEL_LINK = "strata_model.onnx"  # the runner's ONNX_FILE


def stage(model: ModelSource, store: Path) -> None:
    config = with_runner_warmup(with_runner_state(runner_config(model)))
    stage_with_runner(model, store, RUNNER, config, {MODEL_LINK: model.model_filename})


def with_runner_warmup(config: ModelConfig) -> ModelConfig:
    """The runner warms the model up in its `initialize` (a failure fails the load with Triton's message): the
    config's `model_warmup` moves into the parameter `strata_warmup` (JSON). Triton 2.51's own warmup crashes the
    server now and then (SIGSEGV) when a sample fails, where a failed `initialize` is always handled."""
    if config.model_warmup:
        samples = [json_format.MessageToDict(sample) for sample in config.model_warmup]
        config.parameters["strata_warmup"].string_value = json.dumps(samples)
        del config.model_warmup[:]
    return config


def with_runner_state(config: ModelConfig) -> ModelConfig:
    """Triton's Python backend keeps no implicit state: the config's `sequence_batching.state` moves into the
    parameter `strata_sequence_state` (JSON), which the runner keeps per sequence itself."""
    states = config.sequence_batching.state
    if states:
        config.parameters["strata_sequence_state"].string_value = json.dumps(
            [
                {
                    "input_name": s.input_name,
                    "output_name": s.output_name,
                    "data_type": DataType.Name(s.data_type),
                    "dims": list(s.initial_state[0].dims if s.initial_state else s.dims),
                }
                for s in states
            ]
        )
        del config.sequence_batching.state[:]
    return config
