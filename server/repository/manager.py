"""Keeps Triton's model store in step with the operator's repositories, under Triton's three control modes.

- none: load every model at start; later changes on disk are ignored.
- poll: rescan every `poll_secs`; a model whose files changed is applied only once two consecutive scans see the
  same files (so a half-copied model is never loaded); new models load, removed ones unload, edits reload.
  A broken edit never replaces a serving version: the old one keeps serving and the error is logged.
- explicit: stage every model (so the repository index lists them all) but load only `startup_models`
  (`*` for all) and what clients ask for through Triton's repository API.

The manager decides when a model is staged, loaded and unloaded; how is up to the backend the `BackendRegistry`
holds for the model's backend name. A model that cannot be served (a `BrokenModel`, or a backend this server does
not run) goes to the registry's placeholder, which shows it UNAVAILABLE with the reason.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from server.repository.backend import BackendRegistry, LoadError, ModelBackend
from server.repository.scan import BrokenModel, Fingerprint, ModelSource, scan

log = logging.getLogger(__name__)


class ControlMode(StrEnum):
    NONE = "none"
    POLL = "poll"
    EXPLICIT = "explicit"


@dataclass(slots=True)
class ModelEntry:
    model: ModelSource | BrokenModel  # what the repository holds now
    serving: Fingerprint | None = None  # files Triton last loaded successfully, None if not serving
    error: str | None = None  # the latest problem with this model, if any


class RepositoryManager:
    def __init__(
        self,
        repositories: Sequence[Path],
        backends: BackendRegistry,
        mode: ControlMode = ControlMode.NONE,
        poll_secs: float = 15.0,
        startup_models: Sequence[str] = (),
        auto_complete: bool = True,
    ) -> None:
        self.repositories = list(repositories)
        self.backends = backends
        self.mode = mode
        self.poll_secs = poll_secs
        self.startup_models = list(startup_models)
        self.auto_complete = auto_complete  # a folder with no config.pbtxt is served (tritonserver's default)
        self.entries: dict[str, ModelEntry] = {}
        self._pending: dict[str, Fingerprint] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        """Stage every model, load those the mode asks for, and start watching the repositories."""
        with self._lock:
            for name, model in scan(self.repositories, self.auto_complete).items():
                self.entries[name] = ModelEntry(model)
                self._stage(name)
            for name in load_order(self.entries, self._startup_set()):
                self._load(name)
        for name in set(self.startup_models) - {"*"} - set(self.entries):
            log.error("--load-model %s: no such model in %s", name, ", ".join(map(str, self.repositories)))
        if self.mode is not ControlMode.NONE:
            self._watcher = threading.Thread(target=self._watch, name="repository-watch", daemon=True)
            self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()

    def rescan(self) -> None:
        """One poll step: apply every change whose files were stable since the previous scan."""
        with self._lock:
            found = scan(self.repositories, self.auto_complete)
            for name, model in found.items():
                entry = self.entries.get(name)
                if entry is not None and entry.model.fingerprint == model.fingerprint:
                    self._pending.pop(name, None)
                    continue
                if self._pending.get(name) != model.fingerprint:
                    self._pending[name] = model.fingerprint  # changed since last scan: wait for it to settle
                    continue
                del self._pending[name]
                self._apply(name, model)
            for name in set(self.entries) - set(found):
                self._remove(name)

    def _startup_set(self) -> set[str]:
        if self.mode is not ControlMode.EXPLICIT or "*" in self.startup_models:
            return set(self.entries)
        return set(self.startup_models)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_secs):
            try:
                self.rescan()
            except OSError:
                log.exception("repository scan failed; retrying in %.1f s", self.poll_secs)

    def _apply(self, name: str, model: ModelSource | BrokenModel) -> None:
        entry = self.entries.setdefault(name, ModelEntry(model))
        if isinstance(model, BrokenModel) and entry.serving is not None:
            entry.error = str(model.error)
            log.error("%s: keeping the serving version of %s: %s", name, name, entry.error)
            entry.model = model
            return
        log.info("%s: repository changed, applying", name)
        entry.model = model
        self._stage(name)
        if self.mode is ControlMode.POLL:
            self._load(name)

    def _stage(self, name: str) -> None:
        entry = self.entries[name]
        backend = self._backend_of(entry.model)
        if backend is None:
            entry.error = _why_unservable(entry.model)
            log.error("%s: cannot serve: %s", name, entry.error)
            self.backends.placeholder.stage(name, entry.error)
            return
        try:
            backend.stage(entry.model)
        except (OSError, ValueError) as exc:  # a model file that cannot be linked or read: this model only
            entry.error = f"{entry.model.path}: cannot stage: {exc}"
            log.error("%s: %s", name, entry.error)
            self.backends.placeholder.stage(name, entry.error)

    def _load(self, name: str) -> None:
        entry = self.entries[name]
        model = entry.model
        backend = self._backend_of(model)
        if backend is None:
            self.backends.placeholder.load(name)  # fails by design; _stage logged why
            return
        try:
            backend.load(model)
        except LoadError as exc:
            entry.error = str(exc)
            log.error("%s: load failed: %s", name, entry.error, exc_info=exc.__cause__)
            return
        entry.serving, entry.error = model.fingerprint, None
        log.info("%s: serving version(s) %s", name, ", ".join(map(str, model.versions)))

    def _remove(self, name: str) -> None:
        entry = self.entries.pop(name)
        log.info("%s: removed from the repository, unloading", name)
        backend = self._backend_of(entry.model)
        if backend is None:
            self.backends.placeholder.unload(name)
        else:
            backend.unload(name)

    def _backend_of(self, model: ModelSource | BrokenModel) -> ModelBackend | None:
        """The backend that serves `model`; None for a broken model or a backend this server does not run."""
        if isinstance(model, BrokenModel):
            return None
        return self.backends.backends.get(model.backend)


def load_order(entries: dict[str, ModelEntry], names: set[str]) -> list[str]:
    """`names` in the order to load them: each ensemble after the models its steps name (else Triton loads a step
    model for the ensemble, and Strata loads it again)."""
    order: list[str] = []

    def place(name: str, path: frozenset[str]) -> None:
        if name in order or name not in names or name in path:  # a cycle is Triton's to report
            return
        model = entries[name].model
        if isinstance(model, ModelSource):
            for step in model.config.ensemble_scheduling.step:
                place(step.model_name, path | {name})
        order.append(name)

    for name in sorted(names):
        place(name, frozenset())
    return order


def _why_unservable(model: ModelSource | BrokenModel) -> str:
    if isinstance(model, BrokenModel):
        return str(model.error)
    return f'backend "{model.backend}" is not enabled in this server'
