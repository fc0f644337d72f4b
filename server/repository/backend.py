"""What the repository needs from the backends, declared here so that the repository imports none of them.

The manager scans folders and runs the control modes; it knows no backend. `server.backends.registry` builds a
`BackendRegistry` (a `ModelBackend` for each backend name of `model_config`, and the `Placeholder` that lists a
model no backend can serve) and `strata serve` hands it to the `RepositoryManager`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from server.repository.scan import ModelSource


class LoadError(Exception):
    """A model that did not load; the message is the reason an operator reads (Triton's, or the backend's)."""


class ModelBackend(Protocol):
    """Serves one kind of model (`backend` in config.pbtxt) through Triton."""

    def stage(self, model: ModelSource) -> None:
        """List the model in Triton's repository index without loading it (explicit mode stops here)."""
        ...

    def load(self, model: ModelSource) -> None:
        """Serve the model's chosen versions, replacing what serves now; raise LoadError with the reason."""
        ...

    def unload(self, name: str) -> None:
        """Stop serving `name`, if it serves, and take it out of Triton's model store."""
        ...


class Placeholder(Protocol):
    """Lists a model that cannot be served, so that Triton's index shows it UNAVAILABLE with the reason."""

    def stage(self, name: str, reason: str) -> None:
        """Put `name` in Triton's model store as a model whose load fails with `reason`."""
        ...

    def load(self, name: str) -> None:
        """Have Triton try it: the load fails by design, and the index shows the model UNAVAILABLE with the reason."""
        ...

    def unload(self, name: str) -> None:
        """Take `name` out of Triton and its model store."""
        ...


@dataclass(frozen=True, slots=True)
class BackendRegistry:
    """The backends this server runs, by backend name (model_config.PYTHON, LIBTORCH, LLM), and the placeholder."""

    backends: Mapping[str, ModelBackend]
    placeholder: Placeholder
