"""Tracing, request ids and JSON logs of the OpenAI port over the real SmolLM2 engine in this process, spans caught
by the OpenTelemetry SDK's in-memory exporter (the cross-process traces: tests/server/test_workers.py and
test_disagg_serve.py, through a real OTLP/HTTP receiver)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import serve_app
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from harness.waiting import wait_for
from server import tracing
from server.engine.config import EngineConfig
from server.engine.llm_engine import LLMEngine
from server.logs import JSONFormatter
from server.openai.app import build_app

MODEL_CACHE = Path(__file__).resolve().parents[2] / ".strata-cache" / "models"  # shared with tests/engine
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
MESSAGES = [{"role": "user", "content": "Tell me a short story about a lighthouse."}]


class Collector:
    """The process's tracing, to an in-memory exporter; `configure` starts over with a new one (a replaced provider
    shuts its exporter down)."""

    def __init__(self) -> None:
        self.configure(1.0)

    def configure(self, sample_ratio: float) -> None:
        self.exporter = InMemorySpanExporter()
        tracing.configure(None, sample_ratio, "test", processor=SimpleSpanProcessor(self.exporter))


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[str, Collector]]:
    """The app over SmolLM2 with tracing on (every new trace sampled), and the spans it finished."""
    config = EngineConfig(
        cache_dir=str(MODEL_CACHE), dtype="float32", device="cpu", num_kv_blocks=200, max_model_len=1024,
        max_tokens_limit=64, num_threads=2, model_name="smollm2", max_num_batched_tokens=32,
    )  # fmt: skip
    collector = Collector()
    try:
        with LLMEngine(config) as engine, serve_app(build_app({"smollm2": engine})) as url:
            yield url, collector
    finally:
        tracing.shutdown()


def all_spans(exporter: InMemorySpanExporter, count: int = 1) -> list[ReadableSpan]:
    """The finished spans once `count` server spans are among them: a server span ends after its response's last
    byte is sent, so a client may read the answer first."""
    done = lambda: len(by_name(exporter.get_finished_spans(), "POST /v1/chat/completions")) >= count  # noqa: E731
    wait_for(done, 10, what=f"{count} server spans")
    return list(exporter.get_finished_spans())


def by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def chat(
    url: str, headers: dict[str, str], stream: bool = True, max_tokens: int = 6, messages: list | None = None
) -> httpx.Response:
    body = {
        "model": "smollm2",
        "messages": messages or MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def usage_of(response: httpx.Response) -> dict:
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
    return json.loads(events[-1])["usage"]


@pytest.mark.slow
def test_a_streamed_chat_is_one_trace_from_the_clients_span_to_the_engine_steps(traced) -> None:
    url, collector = traced
    collector.configure(1.0)
    exporter = collector.exporter
    response = chat(url, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    assert response.status_code == 200
    usage = usage_of(response)
    spans = all_spans(exporter)
    assert {f"{span.context.trace_id:032x}" for span in spans} == {TRACE_ID}
    (server,) = by_name(spans, "POST /v1/chat/completions")
    assert f"{server.parent.span_id:016x}" == CLIENT_SPAN  # continues the client's traceparent
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["strata.request_id"] == response.headers["x-request-id"]
    (generation,) = by_name(spans, "chat smollm2")
    assert generation.parent.span_id == server.context.span_id
    assert generation.attributes["gen_ai.request.model"] == "smollm2"
    assert generation.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert generation.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert generation.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert [event.name for event in generation.events] == ["gen_ai.first_token"]
    (engine,) = by_name(spans, "strata.engine.request")
    assert engine.parent.span_id == generation.context.span_id
    assert engine.attributes["strata.request_id"] == f"{response.headers['x-request-id']}-0"
    assert engine.attributes["strata.finish_reason"] == "length"
    assert [event.name for event in engine.events] == ["first_token"]
    children = [
        span for span in spans if span.parent is not None and span.parent.span_id == engine.context.span_id
    ]
    assert {span.name for span in children} == {
        "strata.engine.decode",
        "strata.engine.prefill",
        "strata.engine.queue",
    }
    prefills = sorted(by_name(spans, "strata.engine.prefill"), key=lambda span: span.start_time)
    assert sum(span.attributes["strata.prefill.tokens"] for span in prefills) == usage["prompt_tokens"]
    (queue,) = by_name(spans, "strata.engine.queue")
    (decode,) = by_name(spans, "strata.engine.decode")
    assert (
        queue.end_time <= prefills[0].start_time
        and prefills[-1].end_time <= decode.start_time <= engine.end_time
    )
    assert decode.attributes["gen_ai.usage.output_tokens"] == 6
    assert generation.start_time <= engine.start_time and engine.end_time <= generation.end_time


@pytest.mark.slow
def test_a_prompt_in_chunks_has_a_span_per_chunk_and_a_repeat_prefills_only_what_is_not_cached(
    traced,
) -> None:
    url, collector = traced
    collector.configure(1.0)
    exporter = collector.exporter
    messages = [
        {
            "role": "user",
            "content": "Describe, in plain words, how a paged KV cache lets requests share a prompt. " * 3,
        }
    ]
    parent = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
    first = chat(url, parent, stream=False, max_tokens=2, messages=messages).json()["usage"]
    again = chat(url, parent, stream=False, max_tokens=2, messages=messages).json()["usage"]
    spans = all_spans(exporter, 2)
    engines = sorted(by_name(spans, "strata.engine.request"), key=lambda span: span.start_time)
    cached = [
        usage["prompt_tokens_details"]["cached_tokens"] for usage in (first, again)
    ]  # the template's start
    assert [span.attributes["strata.usage.cached_tokens"] for span in engines] == cached
    assert cached[1] > cached[0]
    for engine, prompt_cached in zip(engines, cached, strict=True):
        chunks = sorted(
            (
                span
                for span in by_name(spans, "strata.engine.prefill")
                if span.parent.span_id == engine.context.span_id
            ),
            key=lambda span: span.attributes["strata.prefill.first_position"],
        )
        positions = [span.attributes["strata.prefill.first_position"] for span in chunks]
        tokens = [span.attributes["strata.prefill.tokens"] for span in chunks]
        assert positions[0] == prompt_cached and all(n <= 32 for n in tokens)  # --max-num-batched-tokens 32
        assert sum(tokens) == first["prompt_tokens"] - prompt_cached
    assert len(by_name(spans, "strata.engine.prefill")) >= first["prompt_tokens"] // 32


@pytest.mark.slow
def test_new_traces_follow_the_sample_ratio_and_a_clients_sampled_flag_wins(traced) -> None:
    url, collector = traced
    collector.configure(0.0)
    exporter = collector.exporter
    try:
        assert chat(url, {}, stream=False, max_tokens=1).status_code == 200  # a new trace, ratio 0
        assert exporter.get_finished_spans() == ()
        assert chat(url, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-00"}, stream=False, max_tokens=1)
        assert exporter.get_finished_spans() == ()  # the client did not sample it
        chat(url, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}, stream=False, max_tokens=1)
        names = {span.name for span in all_spans(exporter)}
        assert {"POST /v1/chat/completions", "chat smollm2", "strata.engine.request"} <= names
    finally:
        collector.configure(1.0)


@pytest.mark.slow
def test_json_log_lines_carry_the_request_and_trace_ids(traced) -> None:
    url, _ = traced
    lines = io.StringIO()
    handler = logging.StreamHandler(lines)
    handler.setFormatter(JSONFormatter("server"))
    access = logging.getLogger("strata.access")
    level = access.level
    access.setLevel(logging.INFO)
    access.addHandler(handler)
    try:
        response = chat(
            url, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "X-Request-Id": "client-7"}, stream=False
        )
        wait_for(
            lambda: lines.getvalue().endswith("\n"), 10, what="the access line (written after the answer)"
        )
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    (line,) = [json.loads(text) for text in lines.getvalue().splitlines()]
    assert line["request_id"] == response.headers["x-request-id"] != "client-7"
    assert line["trace_id"] == TRACE_ID and len(line["span_id"]) == 16
    assert line["logger"] == "strata.access" and line["level"] == "INFO"
    assert '"POST /v1/chat/completions" 200' in line["message"]
    assert "client_request_id=client-7" in line["message"]
