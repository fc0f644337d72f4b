"""What /v1/embeddings and /v1/models need of an embedding model: the `Embedder` protocol (server/embeddings.py
implements it over Triton)."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class EmbedderUnavailable(Exception):
    """The model cannot embed now (not loaded, its server gone); the message says why."""


class Embedder(Protocol):
    """One embedding model of the repository."""

    dimensions: int  # of each embedding
    takes_tokens: bool  # input as token ids; else as text

    async def embed(self, inputs: list[str] | list[list[int]]) -> tuple[np.ndarray, list[int] | None]:
        """float32 [len(inputs), dimensions], and each input's token count when the model reports it; raises
        EmbedderUnavailable."""
        ...
