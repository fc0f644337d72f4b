"""OpenVINO models (`backend: "openvino"`): an IR model, `model.xml` (or the file `default_model_filename` names)
and its weights, the `.bin` file of the same name.

Triton's OpenVINO backend ships in NVIDIA's containers only, so Strata serves these through Triton's Python backend
with the runner ONNX models use (`stubs/runtime_model.py`), on the `openvino` wheel's CPU plugin. That wheel is
large (about 180 MB installed), so it is an extra: `pip install 'strata[openvino]'`. Without it such a model is
UNAVAILABLE with a reason naming the extra. Implicit state and sequence control work as for ONNX models.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from server.backends.onnx import RUNNER, with_runner_state, with_runner_warmup
from server.backends.staging import runner_config, stage_with_runner
from server.repository.scan import ModelSource

MODEL_LINK = "strata_model.xml"  # the runner's OPENVINO_FILE
WEIGHTS_LINK = "strata_model.bin"  # the runner's OPENVINO_WEIGHTS


class MissingExtra(ValueError):
    """The openvino wheel is not installed in the server's environment."""


def stage(model: ModelSource, store: Path) -> None:
    if importlib.util.find_spec("openvino") is None:
        raise MissingExtra(
            'backend "openvino" needs the openvino wheel: install Strata with the extra, pip install "strata[openvino]"'
        )
    weights = str(Path(model.model_filename).with_suffix(".bin"))
    links = {MODEL_LINK: model.model_filename, WEIGHTS_LINK: weights}
    config = with_runner_warmup(with_runner_state(runner_config(model)))
    stage_with_runner(model, store, RUNNER, config, links)
