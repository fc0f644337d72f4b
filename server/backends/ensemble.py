"""Ensembles (`platform: "ensemble"`): a config and empty version folders, run by Triton's core.

Staged as Python models are (`python.stage`: the config and links to the version folders). Triton checks an
ensemble's steps (models that exist, input and output maps that match) before it creates any version, so a failed
ensemble has no state in Triton's index: `EnsembleBackend` then lists it as a placeholder that fails with Triton's
reason, so the index shows it UNAVAILABLE with that reason. The manager loads an ensemble after its step models.
"""

from __future__ import annotations

from tritonclient.utils import InferenceServerException

from server.backends import python
from server.backends.staging import ModelLoader, StagedBackend, stage_reason
from server.repository.backend import LoadError
from server.repository.scan import ModelSource


class EnsembleBackend(StagedBackend):
    def __init__(self, triton: ModelLoader) -> None:
        super().__init__(triton, python.stage)

    def load(self, model: ModelSource) -> None:
        try:
            super().load(model)
        except LoadError as exc:
            if model.name in self._failed:  # nothing of it serves: list the reason in its place
                stage_reason(model.name, str(exc), self.triton.store, model.versions)
                try:
                    self.triton.load(model.name)
                except InferenceServerException:
                    pass  # fails by design: the index now shows the reason
            raise
