"""Find the models in one or more repository folders and decide which versions each one serves.

Layout (Triton's): <repository>/<model>/config.pbtxt and <repository>/<model>/<version>/<model file>, where
<version> is a positive integer. A scan never raises for one bad model: it returns a `BrokenModel` for it and goes on.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format

from server.errors import ConfigError
from server.repository.model_config import (
    DEFAULT_FILENAME,
    ENSEMBLE,
    LLM_BACKENDS,
    ONNXRUNTIME,
    OPENVINO,
    PYTHON,
    ModelConfig,
    backend_of,
    check_name,
    parse_config,
    read_config,
)

Fingerprint = tuple[tuple[str, int, int], ...]  # (relative path, size in bytes, mtime in ns) of every file

# Triton's auto-complete of a folder with no config.pbtxt: the model file says which backend serves it (the
# backend then completes inputs, outputs and max_batch_size from the model itself)
_BACKEND_BY_FILE = (
    ("model.onnx", ONNXRUNTIME, "onnxruntime_onnx"),
    ("model.xml", OPENVINO, ""),
    ("model.py", PYTHON, ""),
)


@dataclass(slots=True)
class ModelSource:
    """A model whose config parsed and whose chosen versions have their files."""

    name: str
    path: Path
    config: ModelConfig
    config_text: str
    backend: str
    versions: list[int]  # served versions, ascending
    fingerprint: Fingerprint

    @property
    def model_filename(self) -> str:
        """The file each version folder holds ("" for an ensemble, which has none)."""
        return self.config.default_model_filename or DEFAULT_FILENAME.get(self.backend, "")


@dataclass(slots=True)
class BrokenModel:
    """A model folder that cannot be served as it is; `error` says where and why."""

    name: str
    path: Path
    error: ConfigError
    fingerprint: Fingerprint


def fingerprint(folder: Path) -> Fingerprint:
    """What changes whenever any file under `folder` is written, added or removed (stat only, no reads)."""
    entries = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            full = Path(root, name)
            try:
                stat = full.stat()
            except OSError:  # removed while we walked: the next scan sees a different fingerprint anyway
                continue
            entries.append((str(full.relative_to(folder)), stat.st_size, stat.st_mtime_ns))
    return tuple(entries)


def scan(repositories: Iterable[Path], auto_complete: bool = True) -> dict[str, ModelSource | BrokenModel]:
    """Every model folder of every repository, by model name; `auto_complete` (tritonserver's default) serves a
    folder with no config.pbtxt whose model file names its backend."""
    found: dict[str, ModelSource | BrokenModel] = {}
    for repository in repositories:
        for folder in sorted(p for p in repository.iterdir() if p.is_dir() and not p.name.startswith(".")):
            model = read_model(folder, auto_complete)
            previous = found.get(folder.name)
            if previous is not None:
                message = f"model name also used by {previous.path}; names must be unique across repositories"
                model = BrokenModel(folder.name, folder, ConfigError(folder, message), model.fingerprint)
            found[folder.name] = model
    for name, model in found.items():
        if isinstance(model, ModelSource):
            found[name] = without_llm_steps(model, found)
    return found


def without_llm_steps(
    model: ModelSource, found: dict[str, ModelSource | BrokenModel]
) -> ModelSource | BrokenModel:
    """An ensemble whose step is an LLM model is broken: an LLM is served through PyTriton's binding, whose proxy
    model Triton cannot load a second time for an ensemble (the load fails, and the ensemble answers with the
    prompt alone)."""
    for step in model.config.ensemble_scheduling.step:
        other = found.get(step.model_name)
        if isinstance(other, ModelSource) and other.backend in LLM_BACKENDS:
            message = (
                f'step "{step.model_name}" is an LLM model (backend {other.backend}): LLMs are served through '
                "PyTriton's binding, which Triton cannot load as an ensemble step; call the LLM's generate "
                "endpoint or the OpenAI API instead"
            )
            error = ConfigError(
                model.path / "config.pbtxt", message, _line_of_step(model.config_text, step.model_name)
            )
            return BrokenModel(model.name, model.path, error, model.fingerprint)
    return model


def _line_of_step(text: str, step_name: str) -> int | None:
    """1-based line of the first `model_name: "<step_name>"` in the text."""
    at = text.find(f'"{step_name}"')
    return text.count("\n", 0, at) + 1 if at >= 0 else None


def read_model(folder: Path, auto_complete: bool = True) -> ModelSource | BrokenModel:
    stamp = fingerprint(folder)
    try:
        return _read_model(folder, stamp, auto_complete)
    except ConfigError as error:
        return BrokenModel(folder.name, folder, error, stamp)


def _read_model(folder: Path, stamp: Fingerprint, auto_complete: bool) -> ModelSource:
    config_path = folder / "config.pbtxt"
    if config_path.is_file():
        text = read_config(config_path)
    elif auto_complete:
        text = minimal_config(folder, config_path)
    else:
        raise ConfigError(
            config_path, "missing, and auto-complete is off (--disable-auto-complete-config): write one"
        )
    config = parse_config(config_path, text)
    check_name(config, folder.name, config_path, text)
    backend = backend_of(config, config_path, text)
    if not config.name:
        config.name = folder.name
    source = ModelSource(folder.name, folder, config, text, backend, [], stamp)
    source.versions = select_versions(config, folder, config_path)
    for version in source.versions:
        model_file = folder / str(version) / source.model_filename
        if backend != ENSEMBLE and not model_file.exists():
            raise ConfigError(model_file, f"missing: version {version} has no {source.model_filename}")
    return source


def minimal_config(folder: Path, config_path: Path) -> str:
    """The config Triton starts from when a model has no config.pbtxt: its name and the backend its newest
    version's file implies; the backend completes the rest (Triton's auto-complete)."""
    versions = sorted(
        (p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
    )
    for version in reversed(versions):
        for filename, backend, platform in _BACKEND_BY_FILE:
            if (version / filename).exists():
                config = ModelConfig(name=folder.name, backend=backend, platform=platform)
                return text_format.MessageToString(config)
    files = ", ".join(name for name, _, _ in _BACKEND_BY_FILE)
    raise ConfigError(
        config_path, f"missing, and no version folder holds a file auto-complete knows ({files})"
    )


def select_versions(config: ModelConfig, folder: Path, config_path: Path) -> list[int]:
    """The versions `version_policy` serves (Triton's default: the latest one)."""
    available = sorted(
        int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name) > 0
    )
    if not available:
        raise ConfigError(folder, "no version folder: expected <model>/<N>/ with N a positive integer")
    policy = config.version_policy.WhichOneof("policy_choice")
    if policy == "all":
        return available
    if policy == "specific":
        wanted = sorted(set(config.version_policy.specific.versions))
        missing = [v for v in wanted if v not in available]
        if missing:
            raise ConfigError(
                config_path,
                f"version_policy.specific names version(s) {missing} with no folder under {folder}",
            )
        return wanted
    count = config.version_policy.latest.num_versions if policy == "latest" else 1
    if count < 1:
        raise ConfigError(config_path, "version_policy.latest.num_versions must be at least 1")
    return available[-count:]
