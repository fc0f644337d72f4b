"""A model Strata cannot serve, staged so that Triton's repository index shows it UNAVAILABLE with Strata's reason.

The staged model's `initialize` raises the error text (file, line, message), so `get_model_repository_index()` and
a `load_model()` through tritonclient report exactly what the log says. `UnavailableBackend` is the repository's
`Placeholder`; the LLM backend stages the same placeholder while a model's engine is not running.
"""

from __future__ import annotations

from tritonclient.utils import InferenceServerException

from server.backends.staging import ModelLoader, retire, stage_reason


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
        retire(self.triton, name)


STARTUP_MODEL = "strata_loading_repository"


class StartupHold:
    """Keeps a strict-readiness Triton not ready until Strata has loaded the repository at start.

    Triton's strict readiness covers only the models it has been asked to load, and Strata asks for them one at a
    time after Triton is up: between loads Triton would say ready with models still missing. The hold is a
    placeholder that fails to load, staged before Triton starts so that Triton loads it at start (PyTriton starts
    Triton with `--load-model=*`): Triton is never ready before `release` retires it.
    """

    def __init__(self, triton: ModelLoader) -> None:
        self.triton = triton
        stage_reason(STARTUP_MODEL, "Strata is loading the model repository", triton.store)

    def release(self) -> None:
        retire(self.triton, STARTUP_MODEL)
