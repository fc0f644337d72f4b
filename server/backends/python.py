"""Triton Python-backend models (`model.py` with `TritonPythonModel`), run by Triton's own Python backend.

Running them inside the Python backend bundled with PyTriton's Triton gives them the real
`triton_python_backend_utils` (every API a model may use) and the bare binary's round trip, shorter than a
PyTriton-bound callable's. The staged folder holds a copy of the validated config and symlinks to the
chosen version folders and any other files of the model, so nothing is copied. `stage` is all this backend adds to
`staging.StagedBackend`.
"""

from __future__ import annotations

from pathlib import Path

from server.backends.staging import link, prune, write_atomic
from server.repository.scan import ModelSource


def stage(model: ModelSource, store: Path) -> None:
    folder = store / model.name
    folder.mkdir(parents=True, exist_ok=True)
    keep = {"config.pbtxt"}
    for entry in model.path.iterdir():
        if entry.name == "config.pbtxt" or entry.name == "__pycache__":
            continue
        if entry.name.isdigit() and int(entry.name) not in model.versions:
            continue
        link(entry.resolve(), folder / entry.name)
        keep.add(entry.name)
    prune(folder, keep)
    write_atomic(folder / "config.pbtxt", model.config_text)
