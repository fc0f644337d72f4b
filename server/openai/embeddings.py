"""POST /v1/embeddings: OpenAI's embeddings over the repository's embedding models (server/embeddings.py says which
models are, and runs them in Triton).

`input` is a string, a list of strings, a list of token ids or a list of them (token ids only for a model that
takes them); `encoding_format` is "float" (JSON numbers) or "base64" (the float32 little-endian bytes, what the
official client asks for by default); `dimensions` is accepted only when it is the model's own. A request's inputs
go to the model in batches of its max_batch_size, sent together.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Literal

import msgspec
import numpy as np
from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import ConfigDict, Field

from server.openai.embedder import Embedder, EmbedderUnavailable
from server.openai.errors import ERROR_BODY, OpenAIError, unknown_model
from server.openai.protocol import StrictRequest
from server.openai.served import ServedModels

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request


class EmbeddingRequest(StrictRequest):
    model_config = ConfigDict(extra="forbid", strict=True)  # a field OpenAI defines but Strata lacks is named

    model: str
    input: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = (
        None  # the end user's id (OpenAI's, for abuse monitoring): accepted, it changes nothing
    )

    def inputs(self) -> list[str] | list[list[int]]:
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]  # type: ignore[list-item]
        return value  # type: ignore[return-value]


def router(served: ServedModels, embedders: Mapping[str, Embedder]) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/embeddings", responses={400: ERROR_BODY, 404: ERROR_BODY, 503: ERROR_BODY})
    async def embeddings(body: EmbeddingRequest) -> Response:
        embedder = embedders.get(body.model)
        if embedder is None:
            served.count_invalid(body.model)
            if body.model in served.models:
                raise OpenAIError(
                    400,
                    f"model `{body.model}` is not an embedding model",
                    param="model",
                    code="wrong_model_type",
                )
            raise unknown_model(body.model)
        inputs = _checked(served, body, embedder)
        try:
            vectors, tokens = await embedder.embed(inputs)
        except EmbedderUnavailable as exc:
            served.count(body.model, "error")
            raise OpenAIError(
                503, f"model `{body.model}` cannot embed now: {exc}", "service_unavailable"
            ) from None
        served.count(body.model, "success")
        counted = sum(tokens) if tokens is not None else sum(len(i) for i in inputs if isinstance(i, list))
        return Response(msgspec.json.encode(_answer(body, vectors, counted)), media_type="application/json")

    return routes


def _checked(served: ServedModels, body: EmbeddingRequest, embedder: Embedder) -> list[str] | list[list[int]]:
    inputs = body.inputs()
    if len(inputs) > MAX_INPUTS:
        served.refuse(
            body.model, f"input: at most {MAX_INPUTS} inputs per request, got {len(inputs)}", "input"
        )
    if body.dimensions is not None and body.dimensions != embedder.dimensions:
        served.refuse(
            body.model,
            f"dimensions: model `{body.model}` makes {embedder.dimensions}-dimensional embeddings only",
            "dimensions",
        )
    as_tokens = isinstance(inputs[0], list)
    if as_tokens != embedder.takes_tokens:
        takes = "token ids" if embedder.takes_tokens else "text"
        served.refuse(body.model, f"input: model `{body.model}` takes {takes}", "input")
    if any(len(i) == 0 for i in inputs):
        served.refuse(body.model, "input: an input is empty", "input")
    return inputs


def _answer(body: EmbeddingRequest, vectors: np.ndarray, tokens: int) -> dict:
    if body.encoding_format == "base64":
        little = vectors.astype("<f4", copy=False)
        data = [base64.b64encode(row.tobytes()).decode() for row in little]
    else:
        data = vectors.tolist()
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
        "model": body.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
