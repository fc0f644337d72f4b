"""`pytorch_libtorch` models: a TorchScript `model.pt` with Triton's INPUT__0 / OUTPUT__0 naming.

The PyTriton wheel bundles no libtorch backend, so Strata serves TorchScript through Triton's Python backend with a
small runner (`stubs/torchscript_model.py`) that loads the module with torch in the backend's process. The staged
config says backend "python"; each version folder links the TorchScript file as `strata_model.pt`.
`stage` is all this backend adds to `staging.StagedBackend`.
"""

from __future__ import annotations

from pathlib import Path

from server.backends.staging import runner_config, stage_with_runner
from server.repository.scan import ModelSource

RUNNER = Path(__file__).parent / "stubs" / "torchscript_model.py"
MODEL_LINK = "strata_model.pt"  # the runner's MODEL_FILE


def stage(model: ModelSource, store: Path) -> None:
    stage_with_runner(model, store, RUNNER, runner_config(model), {MODEL_LINK: model.model_filename})
