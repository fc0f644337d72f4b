"""Strata's GET and PUT /v1/strata/models/{model}/disagg: the thresholds of conditional disaggregation, which an
operator or an SLA planner may change while serving (404 for a model not served disaggregated)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from server.controls import DisaggControl
from server.engine.api import Engine
from server.openai.errors import ERROR_BODY, OpenAIError

logger = logging.getLogger(__name__)


class DisaggThresholds(BaseModel):
    """Conditional disaggregation's thresholds of one model (`strata serve --max-local-prefill-length`,
    `--max-prefill-queue-size`); in a PUT, a field left out keeps its value."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_local_prefill_length: int | None = Field(None, ge=0, le=1 << 31)
    max_prefill_queue_size: int | None = Field(None, ge=0, le=1 << 31)


_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {**ERROR_BODY, "description": "invalid thresholds; `param` names the field"},
    401: {**ERROR_BODY, "description": "missing or wrong API key (--api-key)"},
    404: {**ERROR_BODY, "description": "unknown model, or not served disaggregated"},
}


def router(models: Mapping[str, Engine]) -> APIRouter:
    routes = APIRouter()

    def disagg_of(model: str) -> DisaggControl:
        control = getattr(models.get(model), "disagg", None)
        if control is None:
            code = "model_not_found" if model not in models else "not_disaggregated"
            raise OpenAIError(
                404, f"The model `{model}` is not served disaggregated", param="model", code=code
            )
        return control

    @routes.get("/v1/strata/models/{model}/disagg", response_model=DisaggThresholds, responses=_RESPONSES)
    async def get_disagg(model: str) -> DisaggThresholds:
        return DisaggThresholds(**disagg_of(model).thresholds())

    @routes.put("/v1/strata/models/{model}/disagg", response_model=DisaggThresholds, responses=_RESPONSES)
    async def set_disagg(model: str, body: DisaggThresholds) -> DisaggThresholds:
        control = disagg_of(model)
        control.set(body.max_local_prefill_length, body.max_prefill_queue_size)
        logger.info("%s: disaggregation thresholds now %s", model, control.thresholds())
        return DisaggThresholds(**control.thresholds())

    return routes
