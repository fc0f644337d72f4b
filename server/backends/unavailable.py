"""A model Strata cannot serve, staged so that Triton's repository index shows it UNAVAILABLE with Strata's reason.

The staged model's `initialize` raises the error text (file, line, message), so `get_model_repository_index()` and
a `load_model()` through tritonclient report exactly what the log says. `UnavailableBackend` is the repository's
`Placeholder`; the LLM backend stages the same placeholder while a model's engine is not running.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.utils import InferenceServerException

from server.backends.staging import ModelLoader, link, prune, unload_staged, write_atomic
from server.repository.model_config import ModelConfig

RUNNER = Path(__file__).parent / "stubs" / "unavailable_model.py"


class UnavailableBackend:
    """Lists models that cannot be served (see server.repository.backend.Placeholder)."""

    def __init__(self, triton: ModelLoader) -> None:
        self.triton = triton

    def stage(self, name: str, reason: str) -> None:
        stage_reason(name, reason, self.triton.store)

    def load(self, name: str) -> None:
        try:
            self.triton.load(name)
        except InferenceServerException:
            pass  # fails by design: Triton now lists the model UNAVAILABLE with the reason

    def unload(self, name: str) -> None:
        unload_staged(self.triton, name)


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
