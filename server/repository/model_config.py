"""Read a model's `config.pbtxt` into Triton's own `ModelConfig` message and check what Triton would reject later.

Every problem becomes a `ConfigError` that names the file, the line when known, and the field, so an operator can
fix it from the log or from the repository index reason alone.
"""

from __future__ import annotations

import re
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from server.errors import ConfigError

ModelConfig = model_config_pb2.ModelConfig

# backend names Strata serves, by what config.pbtxt says (backend or platform)
PYTHON = "python"
LIBTORCH = "pytorch"
LLM = "strata_llm"
VLLM = "vllm"  # Triton's vLLM backend: model.json holds vLLM's engine arguments, vLLM runs them (server/vllm_engine)
LLM_BACKENDS = (LLM, VLLM)
ONNXRUNTIME = "onnxruntime"
OPENVINO = "openvino"
ENSEMBLE = "ensemble"  # run by Triton's core: no files, only the steps' models
_BACKEND_ALIASES = {
    "python": PYTHON,
    "pytorch": LIBTORCH,
    "pytorch_libtorch": LIBTORCH,
    "onnxruntime": ONNXRUNTIME,
    "onnxruntime_onnx": ONNXRUNTIME,
    "openvino": OPENVINO,
    "ensemble": ENSEMBLE,
    "strata_llm": LLM,
    "vllm": VLLM,
}
# Triton's backends and platforms that need hardware or software no CPU machine has, and why (the reason a
# refused model shows in the repository index)
_REFUSED = {
    "tensorrt_plan": "TensorRT plans run on NVIDIA GPUs only",
    "tensorrt": "TensorRT plans run on NVIDIA GPUs only",
    "tensorrtllm": "TensorRT-LLM engines run on NVIDIA GPUs only",
    "tensorflow_graphdef": "Triton's TensorFlow backend is deprecated upstream and ships in NVIDIA's containers only",
    "tensorflow_savedmodel": "Triton's TensorFlow backend is deprecated upstream and ships in NVIDIA's containers only",
    "tensorflow": "Triton's TensorFlow backend is deprecated upstream and ships in NVIDIA's containers only",
    "dali": "the DALI backend needs NVIDIA's DALI build, shipped in NVIDIA's containers only",
    "fil": "the FIL backend needs RAPIDS (CUDA), shipped in NVIDIA's containers only",
}
# what a version folder holds, by backend, when config.pbtxt names no default_model_filename
DEFAULT_FILENAME = {
    PYTHON: "model.py",
    LIBTORCH: "model.pt",
    ONNXRUNTIME: "model.onnx",
    OPENVINO: "model.xml",
    LLM: "model.json",
    VLLM: "model.json",
}


def read_config(path: Path) -> str:
    """The text of config.pbtxt; a file that cannot be read or is not UTF-8 is a ConfigError naming it."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(path, f"cannot read: {exc}") from exc


def parse_config(path: Path, text: str) -> ModelConfig:
    """Parse the text of config.pbtxt (read from `path`) with protobuf's text format."""
    config = ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        message = re.sub(r"^\d+:\d+ : ", "", str(exc))
        raise ConfigError(path, message, exc.GetLine(), exc.GetColumn()) from exc
    return config


def backend_of(config: ModelConfig, path: Path, text: str) -> str:
    """Strata's backend for this config: one of the values of _BACKEND_ALIASES."""
    declared = config.backend or config.platform
    if not declared:
        raise ConfigError(
            path,
            'no "backend" or "platform" given; use backend: "python", "pytorch", "onnxruntime", "openvino" or '
            '"strata_llm", or platform: "ensemble"',
        )
    backend = _BACKEND_ALIASES.get(declared)
    if backend is None:
        field = "backend" if config.backend else "platform"
        allowed = ", ".join(sorted(_BACKEND_ALIASES))
        why = _REFUSED.get(declared, "not supported")
        raise ConfigError(path, f'{field} "{declared}": {why}; supported: {allowed}', _line_of(text, field))
    return backend


def check_name(config: ModelConfig, folder_name: str, path: Path, text: str) -> None:
    """Triton requires the config's name, when given, to match the model's folder."""
    if config.name and config.name != folder_name:
        raise ConfigError(
            path,
            f'name "{config.name}" does not match the model folder "{folder_name}"',
            _line_of(text, "name"),
        )


def _line_of(text: str, field: str) -> int | None:
    """1-based line of the first top-level-looking `field:` in the text, for error messages."""
    match = re.search(rf"^\s*{re.escape(field)}\s*:", text, re.MULTILINE)
    return text.count("\n", 0, match.start()) + 1 if match else None
