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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from google.protobuf import text_format
from tritonclient.utils import InferenceServerException

from server.repository.backend import LoadError
from server.repository.model_config import ModelConfig
from server.repository.scan import ModelSource

log = logging.getLogger(__name__)

RUNNER = Path(__file__).parent / "stubs" / "unavailable_model.py"  # the placeholder's model.py


class ModelLoader(Protocol):
    """What the file backends need from Triton (see server.triton.TritonServer)."""

    store: Path

    def load(self, name: str) -> None: ...

    def unload(self, name: str) -> None: ...

    def wait_unloaded(self, name: str) -> None: ...


class StagedBackend:
    """Models Triton loads from a folder staged in its model store; `stage_model` writes that folder."""

    def __init__(self, triton: ModelLoader, stage_model: Callable[[ModelSource, Path], None]) -> None:
        self.triton = triton
        self._stage_model = stage_model
        self._served: set[str] = set()  # names with a version loaded
        self._failed: dict[
            str, list[int]
        ] = {}  # versions of names that failed with nothing served: retired on unload

    def stage(self, model: ModelSource) -> None:
        self._stage_model(model, self.triton.store)

    def load(self, model: ModelSource) -> None:
        """Load (or reload) the staged folder; LoadError carries Triton's reason."""
        try:
            self.triton.load(model.name)
        except InferenceServerException as exc:
            if model.name not in self._served:  # a failed reload leaves the old versions serving: not failed
                self._failed[model.name] = model.versions
            raise LoadError(exc.message()) from None
        self._served.add(model.name)
        self._failed.pop(model.name, None)

    def unload(self, name: str) -> None:
        self._served.discard(name)
        failed = self._failed.pop(name, None)
        if failed is not None:
            retire(self.triton, name, failed)
        else:
            unload_staged(self.triton, name)


def stage_with_runner(
    model: ModelSource, store: Path, runner: Path, config: ModelConfig, links: dict[str, str]
) -> None:
    """Stage a model that Triton's Python backend serves through `runner` (a model.py of stubs/): each version
    folder links the operator's files, those named in `links` ({staged name: file in the version folder}) under
    the runner's names (ones Triton's own backend detection does not claim, so that a load with an override
    config still finds only model.py), and the runner as model.py; `config` is what Triton loads. A missing file
    is a FileNotFoundError naming it."""
    folder = store / model.name
    folder.mkdir(parents=True, exist_ok=True)
    for version in model.versions:
        source = model.path / str(version)
        version_folder = folder / str(version)
        version_folder.mkdir(exist_ok=True)
        keep = {"model.py", *links}
        for entry in source.iterdir():
            if entry.name not in keep | {"__pycache__", *links.values()}:
                link(entry.resolve(), version_folder / entry.name)
                keep.add(entry.name)
        for staged_name, name in links.items():
            if not (source / name).is_file():
                raise FileNotFoundError(f"{source / name}: missing")
            link((source / name).resolve(), version_folder / staged_name)
        link(runner, version_folder / "model.py")
        prune(version_folder, keep)
    prune(folder, {"config.pbtxt"} | {str(v) for v in model.versions})
    write_atomic(folder / "config.pbtxt", text_format.MessageToString(config))


def runner_config(model: ModelSource) -> ModelConfig:
    """The model's config as Triton's Python backend loads it under a runner: backend "python", the original
    platform or backend kept in the parameter `strata_platform`."""
    config = ModelConfig()
    config.CopyFrom(model.config)
    config.parameters["strata_platform"].string_value = config.platform or config.backend
    config.backend = "python"
    config.platform = ""
    config.default_model_filename = ""
    return config


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


def retire(triton: ModelLoader, name: str, versions: Sequence[int] = (1,)) -> None:
    """Unload a model whose `versions` failed to load, so that Triton forgets the failure.

    Triton keeps a failed load's state (UNAVAILABLE, with its reason) after an unload, and under strict readiness
    that state keeps the whole server not ready, even once the folder is gone. Only an unload of a loaded version
    leaves the state Triton ignores ("unloaded"): the versions are loaded once as a model that loads, then unloaded.
    """
    stage_reason(name, None, triton.store, versions)
    try:
        triton.load(name)
        triton.unload(name)
        triton.wait_unloaded(name)  # Triton unloads in the background; its index needs the staged folder
    except InferenceServerException as exc:
        log.error("%s: could not retire the failed model: %s", name, exc.message())
    remove(triton.store / name)


def stage_reason(name: str, reason: str | None, store: Path, versions: Sequence[int] = (1,)) -> None:
    """Stage `name` as a model whose load fails with `reason` (None: a model that loads; see `retire`)."""
    folder = store / name
    folder.mkdir(parents=True, exist_ok=True)
    for version in versions:
        if (folder / str(version)).is_symlink():  # a staged model's version links to the operator's folder
            remove(folder / str(version))
        (folder / str(version)).mkdir(exist_ok=True)
        link(RUNNER, folder / str(version) / "model.py")
        prune(folder / str(version), {"model.py"})
    prune(folder, {"config.pbtxt", *map(str, versions)})
    config = ModelConfig(name=name, backend="python")
    config.version_policy.specific.versions.extend(versions)
    if reason is not None:
        config.parameters["strata_error"].string_value = reason
    write_atomic(folder / "config.pbtxt", text_format.MessageToString(config))
