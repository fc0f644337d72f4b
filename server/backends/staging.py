"""What the file backends share: the Triton they load through, and symlink trees under its model store.

A staged model is a folder `store/<name>/` that Triton's own Python backend loads: a validated config.pbtxt and
symlinks to the operator's files (nothing is copied). `StagedBackend` is the `ModelBackend` of such models; each
backend file (python.py, pytorch.py) supplies only how its folder is staged.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from tritonclient.utils import InferenceServerException

from server.repository.backend import LoadError
from server.repository.scan import ModelSource

log = logging.getLogger(__name__)


class ModelLoader(Protocol):
    """What the file backends need from Triton (see server.triton.TritonServer)."""

    store: Path

    def load(self, name: str) -> None: ...

    def unload(self, name: str) -> None: ...


class StagedBackend:
    """Models Triton loads from a folder staged in its model store; `stage_model` writes that folder."""

    def __init__(self, triton: ModelLoader, stage_model: Callable[[ModelSource, Path], None]) -> None:
        self.triton = triton
        self._stage_model = stage_model

    def stage(self, model: ModelSource) -> None:
        self._stage_model(model, self.triton.store)

    def load(self, model: ModelSource) -> None:
        """Load (or reload) the staged folder; LoadError carries Triton's reason."""
        try:
            self.triton.load(model.name)
        except InferenceServerException as exc:
            raise LoadError(exc.message()) from None

    def unload(self, name: str) -> None:
        unload_staged(self.triton, name)


def unload_staged(triton: ModelLoader, name: str) -> None:
    """Unload `name` from Triton (a model that never loaded is fine) and remove its staged folder."""
    try:
        triton.unload(name)
    except InferenceServerException as exc:
        log.error("%s: unload failed: %s", name, exc.message())
    remove(triton.store / name)


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` so that a reader sees either the old or the new content, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def link(target: Path, link_path: Path) -> None:
    """Make `link_path` a symlink to `target`, replacing whatever was there."""
    if link_path.is_symlink() and Path(os.readlink(link_path)) == target:
        return
    remove(link_path)
    link_path.symlink_to(target)


def remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def prune(folder: Path, keep: set[str]) -> None:
    """Remove every entry of `folder` whose name is not in `keep`."""
    for entry in folder.iterdir():
        if entry.name not in keep:
            remove(entry)
