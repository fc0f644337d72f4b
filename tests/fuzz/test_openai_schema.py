"""Schemathesis against the OpenAI app's own OpenAPI schema, served by uvicorn over the real SmolLM2 engine.

Every route, streaming included: no 5xx, every status and body as the schema declares it (errors in OpenAI's
shape), each SSE event a valid chunk; afterwards the server is healthy and answers a normal request. Generation
is derandomized (the same cases every run) and bounded: small request limits and a 4-token output cap keep each
case under a second on 2 cores.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from prometheus_client import CollectorRegistry
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from server.engine.config import EngineConfig
from server.engine.llm_engine import LLMEngine
from server.openai.app import build_app
from server.openai.chat_core import ChatCompletionChunk
from server.openai.completions import CompletionResponse
from server.openai.errors import ErrorResponse
from server.openai.limits import RequestLimits
from server.openai.metrics import FrontendMetrics
from tests.openai.conftest import serve_app

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MODEL_CACHE = Path(__file__).resolve().parents[2] / ".strata-cache" / "models"  # shared with tests/engine
LIMITS = RequestLimits(max_request_bytes=64 * 1024, max_n=4, max_prompts=4, max_seqs=8)
SCHEMA = schemathesis.openapi.from_dict(
    build_app({}, FrontendMetrics.create(CollectorRegistry()), limits=LIMITS).openapi()
)
# Not positive_data_acceptance: the schema cannot say which model names exist or how long a context is, so a
# schema-valid request may rightly be a 400 or 404.
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
    unsupported_method,
]


# Numeric sampling fields whose ranges the schema does not state (the engine checks them): random values are
# nearly always out of range, so a third of the positive cases go without them and reach the engine.
_ENGINE_RANGED = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "stop_token_ids",
)


def aim_at_the_engine(case) -> None:
    """Random model names are 404s: two in three positive cases of the fuzzing phase name the served model, half of
    those without the ranged sampling fields. Negative cases stay as generated (they must be refused as they are)."""
    meta = case.meta
    if not isinstance(case.body, dict) or meta is None or meta.generation.mode != GenerationMode.POSITIVE:
        return
    if meta.phase.name.value != "fuzzing":
        return
    variant = zlib.crc32(repr(case.body).encode(errors="backslashreplace")) % 3  # derandomized like the rest
    if variant:
        case.body = {**case.body, "model": MODEL}
    if variant == 2:
        case.body = {key: value for key, value in case.body.items() if key not in _ENGINE_RANGED}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, LLMEngine]]:
    config = EngineConfig(
        cache_dir=str(MODEL_CACHE),
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        max_model_len=128,
        max_tokens_limit=4,
        num_threads=2,
        model_name=MODEL,
    )
    with LLMEngine(config) as engine, serve_app(build_app({MODEL: engine}, limits=LIMITS)) as base_url:
        yield base_url, engine


def sse_events(ctx, response, case) -> None:
    """A streamed answer is SSE events of the operation's chunk model, ending with [DONE] (or one error event)."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return
    events = [line[len("data: ") :] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events, "a stream without events"
    chunk = ChatCompletionChunk if case.path.endswith("/chat/completions") else CompletionResponse
    for event in events[:-1]:
        chunk.model_validate_json(event)
    if events[-1] != "[DONE]":
        error = ErrorResponse.model_validate_json(events[-1])
        raise AssertionError(f"the stream ended with an error event: {error}")


@SCHEMA.parametrize()
@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_openai_routes_keep_their_schema(case, served) -> None:
    base_url, engine = served
    aim_at_the_engine(case)
    case.call_and_validate(base_url=base_url, checks=CHECKS, additional_checks=[sse_events], timeout=60)
    assert engine.healthy


def test_server_still_serves_after_fuzzing(served) -> None:
    base_url, engine = served
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    reply = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0  # nothing left behind by aborted or refused requests
    assert json.loads(httpx.get(f"{base_url}/v1/models").text)["data"][0]["id"] == MODEL
