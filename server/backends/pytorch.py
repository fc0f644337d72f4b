"""`pytorch_libtorch` models: a TorchScript `model.pt` with Triton's INPUT__0 / OUTPUT__0 naming.

The PyTriton wheel bundles no libtorch backend, so Strata serves TorchScript through Triton's Python backend with a
small runner (`stubs/torchscript_model.py`) that loads the module with torch in the backend's process. The staged
config says backend "python" and carries the TorchScript file name in the parameter `strata_torchscript_file`.
`stage` is all this backend adds to `staging.StagedBackend`.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format

from server.backends.staging import link, prune, write_atomic
from server.repository.model_config import ModelConfig
from server.repository.scan import ModelSource

RUNNER = Path(__file__).parent / "stubs" / "torchscript_model.py"


def stage(model: ModelSource, store: Path) -> None:
    folder = store / model.name
    folder.mkdir(parents=True, exist_ok=True)
    for version in model.versions:
        version_folder = folder / str(version)
        version_folder.mkdir(exist_ok=True)
        source = (model.path / str(version) / model.model_filename).resolve()
        link(source, version_folder / source.name)
        link(RUNNER, version_folder / "model.py")
        prune(version_folder, {source.name, "model.py"})
    prune(folder, {"config.pbtxt"} | {str(v) for v in model.versions})
    write_atomic(folder / "config.pbtxt", text_format.MessageToString(runner_config(model)))


def runner_config(model: ModelSource) -> ModelConfig:
    config = ModelConfig()
    config.CopyFrom(model.config)
    config.backend = "python"
    config.platform = ""
    config.default_model_filename = ""
    config.parameters["strata_torchscript_file"].string_value = model.model_filename
    return config
