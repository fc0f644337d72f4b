"""A model Strata cannot serve, staged so that Triton's repository index shows it UNAVAILABLE with Strata's reason.

The staged model's `initialize` raises the error text (file, line, message), so `get_model_repository_index()` and
a `load_model()` through tritonclient report exactly what the log says.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format

from server.backends.staging import link, prune, write_atomic
from server.repository.model_config import ModelConfig
from server.repository.scan import BrokenModel

RUNNER = Path(__file__).parent / "stubs" / "unavailable_model.py"


def stage(model: BrokenModel, store: Path) -> None:
    stage_reason(model.name, str(model.error), store)


def stage_reason(name: str, reason: str, store: Path) -> None:
    """Stage `name` as a model whose load fails with `reason`."""
    folder = store / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "1").mkdir(exist_ok=True)
    link(RUNNER, folder / "1" / "model.py")
    prune(folder / "1", {"model.py"})
    prune(folder, {"config.pbtxt", "1"})
    config = ModelConfig(name=name, backend="python")
    config.version_policy.specific.versions.append(1)
    config.parameters["strata_error"].string_value = reason
    write_atomic(folder / "config.pbtxt", text_format.MessageToString(config))
