"""Backends: how a model of each kind becomes something Triton serves.

File-based backends (python, pytorch) *stage* a model: they write a folder under Triton's model store that Triton's
own Python backend loads. The LLM backend binds Strata's engine through PyTriton instead.
"""

from pathlib import Path
from typing import Protocol

from server.repository.scan import ModelSource


class FileBackend(Protocol):
    def stage(self, model: ModelSource, store: Path) -> None:
        """Write (or refresh) `store/<model.name>/` so that Triton can load the model's chosen versions."""
        ...
