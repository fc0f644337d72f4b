"""Keeps Triton's model store in step with the operator's repositories, under Triton's three control modes.

- none: load every model at start; later changes on disk are ignored.
- poll: rescan every `poll_secs`; a model whose files changed is applied only once two consecutive scans see the
  same files (so a half-copied model is never loaded); new models load, removed ones unload, edits reload.
  A broken edit never replaces a serving version: the old one keeps serving and the error is logged.
- explicit: stage every model (so the repository index lists them all) but load only `startup_models`
  (`*` for all) and what clients ask for through Triton's repository API.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Protocol

from tritonclient.utils import InferenceServerException

from server.backends import python, pytorch, unavailable
from server.backends.staging import remove
from server.repository.model_config import LIBTORCH, LLM, PYTHON
from server.repository.scan import BrokenModel, Fingerprint, ModelSource, scan

log = logging.getLogger(__name__)

_STAGERS: dict[str, Callable[[ModelSource, Path], None]] = {PYTHON: python.stage, LIBTORCH: pytorch.stage}


class ControlMode(str, Enum):
    NONE = "none"
    POLL = "poll"
    EXPLICIT = "explicit"


class ModelLoader(Protocol):
    """What the manager needs from Triton (see server.triton.TritonServer)."""

    store: Path

    def load(self, name: str) -> None: ...

    def unload(self, name: str) -> None: ...


class LLMBackend(Protocol):
    """Serves `strata_llm` models (engine + PyTriton binding); see server.backends.llm."""

    def load(self, model: ModelSource) -> None: ...

    def unload(self, name: str) -> None: ...


@dataclass(slots=True)
class ModelEntry:
    model: ModelSource | BrokenModel  # what the repository holds now
    serving: Fingerprint | None = None  # files Triton last loaded successfully, None if not serving
    error: str | None = None  # the latest problem with this model, if any


class RepositoryManager:
    def __init__(
        self,
        repositories: Sequence[Path],
        triton: ModelLoader,
        mode: ControlMode = ControlMode.NONE,
        poll_secs: float = 15.0,
        startup_models: Sequence[str] = (),
        llm: LLMBackend | None = None,
    ) -> None:
        self.repositories = list(repositories)
        self.triton = triton
        self.mode = mode
        self.poll_secs = poll_secs
        self.startup_models = list(startup_models)
        self.llm = llm
        self.entries: dict[str, ModelEntry] = {}
        self._pending: dict[str, Fingerprint] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        """Stage every model, load those the mode asks for, and start watching the repositories."""
        with self._lock:
            for name, model in scan(self.repositories).items():
                self.entries[name] = ModelEntry(model)
                self._stage(name)
            wanted = self._startup_set()
            for name in sorted(self.entries):
                if name in wanted:
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
            found = scan(self.repositories)
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
        model = entry.model
        if isinstance(model, BrokenModel):
            entry.error = str(model.error)
            log.error("%s: cannot serve: %s", name, entry.error)
            unavailable.stage(model, self.triton.store)
        elif model.backend in _STAGERS:
            _STAGERS[model.backend](model, self.triton.store)
        elif model.backend == LLM and entry.serving is None:
            # listed by the repository index until Strata binds its engine (PyTriton then owns the folder)
            reason = (f"{name} is an LLM model: Strata starts its engine (--load-model {name}, or the none/poll "
                      "control modes); Triton's load_model can only reload an engine Strata already started")
            unavailable.stage_reason(name, reason, self.triton.store)

    def _load(self, name: str) -> None:
        entry = self.entries[name]
        model = entry.model
        try:
            if isinstance(model, ModelSource) and model.backend == LLM:
                self._load_llm(model)
            else:
                self.triton.load(name)
        except InferenceServerException as exc:
            if isinstance(model, ModelSource):  # a BrokenModel's placeholder fails by design; _stage logged why
                entry.error = exc.message()
                log.error("%s: load failed: %s", name, entry.error)
            return
        except Exception as exc:  # an LLM engine that cannot start (bad model.json, weights, worker): not fatal
            entry.error = f"{name}: engine failed to start: {exc}"
            log.exception("%s", entry.error)
            if entry.serving is None:
                unavailable.stage_reason(name, entry.error, self.triton.store)
            return
        if isinstance(model, ModelSource):
            entry.serving, entry.error = model.fingerprint, None
            log.info("%s: serving version(s) %s", name, ", ".join(map(str, model.versions)))

    def _load_llm(self, model: ModelSource) -> None:
        if self.llm is None:
            raise InferenceServerException(f"{model.name}: the LLM backend is not enabled in this server")
        self.llm.load(model)

    def _remove(self, name: str) -> None:
        entry = self.entries.pop(name)
        log.info("%s: removed from the repository, unloading", name)
        try:
            if isinstance(entry.model, ModelSource) and entry.model.backend == LLM and self.llm is not None:
                self.llm.unload(name)
            elif entry.serving is not None or isinstance(entry.model, BrokenModel):
                self.triton.unload(name)
        except InferenceServerException as exc:
            log.error("%s: unload failed: %s", name, exc.message())
        remove(self.triton.store / name)
