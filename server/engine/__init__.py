"""Strata's LLM engine: paged KV cache, prefix caching, continuous batching, own torch forward.

Entry points: `LLMEngine(EngineConfig(...))` / `LLMEngine.from_json("model_repository/<m>/1/model.json")`,
`submit(request, sink)`, and the iterators in `server.engine.stream`.
"""

from server.engine.api import (
    Engine,
    GenerationOutput,
    GenerationRequest,
    OutputSink,
    RequestError,
    RequestId,
    SamplingParams,
)
from server.engine.config import ConfigError, EngineConfig
from server.engine.llm_engine import LLMEngine, PoolStats
from server.engine.stream import aiterate_outputs, generate, iterate_outputs

__all__ = [
    "ConfigError",
    "Engine",
    "EngineConfig",
    "GenerationOutput",
    "GenerationRequest",
    "LLMEngine",
    "OutputSink",
    "PoolStats",
    "RequestError",
    "RequestId",
    "SamplingParams",
    "aiterate_outputs",
    "generate",
    "iterate_outputs",
]
