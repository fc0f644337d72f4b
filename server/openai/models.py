"""GET /v1/models and GET /v1/models/{id}: the served models, each LLM with its context length (tokens), and the
repository's embedding models (no context length: their own config bounds their input)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel

from server.openai.embedder import Embedder
from server.openai.errors import ERROR_BODY, unknown_model
from server.openai.served import ServedModels


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "strata"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def router(served: ServedModels, embedders: Mapping[str, Embedder]) -> APIRouter:
    """Every card says `created`: when this router was built (seconds since the epoch)."""
    created = int(time.time())
    routes = APIRouter()

    @routes.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        cards = [
            ModelCard(id=name, created=created, max_model_len=engine.max_model_len)
            for name, engine in served.models.items()
        ]
        cards += [ModelCard(id=name, created=created) for name in embedders if name not in served.models]
        return ModelList(data=cards)

    @routes.get("/v1/models/{model:path}", response_model=ModelCard, responses={404: ERROR_BODY})
    async def model_card(model: str) -> ModelCard:
        engine = served.models.get(model)
        if engine is None:
            if model in embedders:
                return ModelCard(id=model, created=created)
            raise unknown_model(model)
        return ModelCard(id=model, created=created, max_model_len=engine.max_model_len)

    return routes
