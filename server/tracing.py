"""OpenTelemetry tracing of LLM requests, off unless a process configures it (`--otlp-traces-endpoint`).

One trace per request, across processes: the frontend's server span (a client's W3C `traceparent` is its parent),
the router's placement, the worker's engine spans (queue, tier reads, prefill chunks, decode), a migration's
placement on another worker. What crosses a process is the `traceparent` text of the span to continue
(`GenerationRequest.trace_context`): set only for a sampled request, so an engine that sees None traces nothing.

Every function here costs one attribute read while tracing is off; opentelemetry is imported only by `configure`
(a vLLM worker's venv may lack it). Span and attribute names follow OpenTelemetry's GenAI conventions where they
exist (`gen_ai.*`), else `strata.*`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

Attributes = Mapping[str, Any]
_tracer: Tracer | None = None
_provider: Any = None  # the SDK's TracerProvider, for shutdown
_settings: TracingSettings | None = None  # what configured this process (an endpoint): its children's too


class TracingSettings(msgspec.Struct, frozen=True):
    """--otlp-traces-endpoint (None: tracing off) and --otlp-traces-sample-ratio, as every process of a server
    gets them (worker processes in their spec). ValueError names a bad flag."""

    endpoint: str | None = None
    sample_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"--otlp-traces-sample-ratio: must be in [0, 1], got {self.sample_ratio}")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"--otlp-traces-endpoint: an http:// or https:// URL (OTLP/HTTP), got {self.endpoint!r}"
            )


def configure_from(settings: TracingSettings, service_instance: str) -> bool:
    return configure(settings.endpoint, settings.sample_ratio, service_instance)


def settings() -> TracingSettings:
    """How this process traces (no endpoint: it does not, or only to a test's processor): for its child processes."""
    return _settings or TracingSettings()


def configure(
    endpoint: str | None,
    sample_ratio: float = 1.0,
    service_instance: str = "server",
    processor: SpanProcessor | None = None,
) -> bool:
    """Trace this process: spans go to the OTLP/HTTP `endpoint` (a collector's /v1/traces URL; vLLM's
    --otlp-traces-endpoint), or to `processor` (tests). A new trace (no parent) is sampled with `sample_ratio`; a
    span with a parent follows the parent's decision. Returns whether tracing is on."""
    global _tracer, _provider, _settings
    if endpoint is None and processor is None:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError:
        log.warning("tracing is off in this process: opentelemetry-sdk is not installed in %s", _python())
        return False
    if processor is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint)))
    resource = Resource.create({"service.name": "strata", "service.instance.id": service_instance})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
    provider.add_span_processor(processor)
    shutdown()
    _provider, _tracer = provider, provider.get_tracer("strata")
    _settings = TracingSettings(endpoint, sample_ratio) if endpoint is not None else None
    return True


def shutdown() -> None:
    """Export what is buffered and stop tracing (idempotent)."""
    global _tracer, _provider, _settings
    provider, _provider, _tracer, _settings = _provider, None, None, None
    if provider is not None:
        provider.shutdown()


def enabled() -> bool:
    return _tracer is not None


def start_span(name: str, traceparent: str | None, attributes: Attributes | None = None) -> Span | None:
    """A span continuing `traceparent` (None: not traced, no span), started now. The caller ends it."""
    if _tracer is None or traceparent is None:
        return None
    return _tracer.start_span(name, _parent(traceparent), attributes=attributes)


def record_span(
    name: str, parent: Span | str | None, start_ns: int, end_ns: int, attributes: Attributes | None = None
) -> None:
    """A finished span of [start_ns, end_ns] under `parent` (a span or a traceparent; None: nothing)."""
    if _tracer is None or parent is None:
        return
    context = _parent(parent) if isinstance(parent, str) else _context_of(parent)
    _tracer.start_span(name, context, attributes=attributes, start_time=start_ns).end(end_time=end_ns)


@contextmanager
def span(name: str, traceparent: str | None, attributes: Attributes | None = None) -> Iterator[Span | None]:
    """`start_span` as the current span of the block (`current_traceparent` inside it is its own), ended after it;
    an exception escaping the block is recorded on it. Yields None when not traced."""
    started = start_span(name, traceparent, attributes)
    if started is None:
        yield None
        return
    from opentelemetry import trace

    with trace.use_span(started, end_on_exit=True):
        yield started


def current_traceparent() -> str | None:
    """The `traceparent` of this thread's current span when it is recorded (sampled), else None: what a request
    carries to the next process."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    return traceparent_of(trace.get_current_span())


def set_attributes(attributes: Attributes) -> None:
    """Set `attributes` on this thread's current span (nothing while tracing is off or outside a span)."""
    if _tracer is not None:
        from opentelemetry import trace

        trace.get_current_span().set_attributes(attributes)


def add_event(name: str, attributes: Attributes | None = None) -> None:
    """An event on this thread's current span (nothing while tracing is off or outside a span)."""
    if _tracer is not None:
        from opentelemetry import trace

        trace.get_current_span().add_event(name, attributes)


def traceparent_of(span: Span | None) -> str | None:
    """W3C `traceparent` text of `span` (None when it is None or not recorded)."""
    if span is None or not span.is_recording():
        return None
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def extract(headers: Mapping[str, str]) -> Any:
    """The OpenTelemetry context of a request's `traceparent`/`tracestate` headers (an empty one without)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(headers)


def tracer() -> Tracer | None:
    return _tracer


def _parent(traceparent: str) -> Any:
    return extract({"traceparent": traceparent})


def _context_of(span: Span) -> Any:
    from opentelemetry import trace

    return trace.set_span_in_context(span)


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP base URL (http://collector:4318) gets the traces path; a full URL is kept."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def _python() -> str:
    import sys

    return sys.executable
