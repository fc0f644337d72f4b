"""An OTLP/HTTP trace receiver for tests and benchmarks: what a collector's `/v1/traces` endpoint does, in-process.

Every process of a traced server (the frontend, its worker processes, Triton) posts `ExportTraceServiceRequest`
protobufs here; the receiver keeps each span as a `ReceivedSpan` and wakes whoever waits for one.

    with OTLPReceiver() as collector:
        start_strata(..., "--otlp-traces-endpoint", collector.url)
        spans = collector.wait_for(lambda spans: ..., timeout=30)
"""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    name: str
    service: str  # the resource's service.instance.id (server, a worker id), else its service.name
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: tuple[str, ...] = ()
    event_ns: tuple[int, ...] = ()  # each event's time, as `events`


class OTLPReceiver:
    """A threaded HTTP server on 127.0.0.1 (a free port) taking OTLP/HTTP protobuf trace exports."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                if self.headers.get("Content-Type", "").startswith("application/json"):  # Triton's exporter
                    receiver._add_spans(_json_spans(json.loads(body)))
                else:
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    receiver._add_spans(_protobuf_spans(request))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def wait_for(
        self, condition: Callable[[list[ReceivedSpan]], bool], timeout: float, what: str = "spans"
    ) -> list[ReceivedSpan]:
        """The spans received so far once `condition(spans)` holds (checked at each export); TimeoutError after
        `timeout` s, naming `what` and listing the span names received."""
        with self._changed:
            if not self._changed.wait_for(lambda: condition(list(self.spans)), timeout):
                names = sorted({span.name for span in self.spans})
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; received: {names}")
            return list(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._changed:
            return [span for span in self.spans if span.trace_id == trace_id]

    def _add_spans(self, received: list[ReceivedSpan]) -> None:
        with self._changed:
            self.spans.extend(received)
            self._changed.notify_all()


def _protobuf_spans(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """OTLP/HTTP's binary encoding (the Python SDK's exporter)."""
    received = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        service = resource.get("service.instance.id") or resource.get("service.name", "")
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                received.append(
                    ReceivedSpan(
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                        span.name,
                        str(service),
                        span.start_time_unix_nano,
                        span.end_time_unix_nano,
                        {a.key: _value(a.value) for a in span.attributes},
                        tuple(event.name for event in span.events),
                        tuple(event.time_unix_nano for event in span.events),
                    )
                )
    return received


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


def _json_spans(request: dict[str, Any]) -> list[ReceivedSpan]:
    """OTLP/HTTP's JSON encoding (ids in hex, as the OTLP specification says; Triton's C++ exporter sends it)."""
    received = []
    for resource_spans in request.get("resourceSpans", []):
        resource = _json_attributes(resource_spans.get("resource", {}).get("attributes", []))
        service = resource.get("service.instance.id") or resource.get("service.name", "")
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                received.append(
                    ReceivedSpan(
                        span["traceId"].lower(),
                        span["spanId"].lower(),
                        span.get("parentSpanId", "").lower(),
                        span["name"],
                        str(service),
                        int(span.get("startTimeUnixNano", 0)),
                        int(span.get("endTimeUnixNano", 0)),
                        _json_attributes(span.get("attributes", [])),
                        tuple(event.get("name", "") for event in span.get("events", [])),
                        tuple(int(event.get("timeUnixNano", 0)) for event in span.get("events", [])),
                    )
                )
    return received


def _json_attributes(attributes: list[dict[str, Any]]) -> dict[str, Any]:
    return {a["key"]: next(iter(a.get("value", {}).values()), None) for a in attributes}


def format_tree(spans: list[ReceivedSpan]) -> str:
    """One trace's spans as an indented tree: name, process, start offset and duration in ms, and a few attributes
    (children in start order; a span whose parent was not received is a root)."""
    ids = {span.span_id for span in spans}
    children: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        children.setdefault(span.parent_span_id if span.parent_span_id in ids else "", []).append(span)
    origin = min(span.start_ns for span in spans)
    shown = ("strata.worker.id", "strata.route.overlap_blocks", "strata.route.cost", "strata.prefill.tokens",
             "strata.kvbm.tier", "strata.kvbm.blocks", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
             "strata.migration.from", "strata.finish_reason")  # fmt: skip
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s.start_ns):
            start, took = (span.start_ns - origin) / 1e6, (span.end_ns - span.start_ns) / 1e6
            notes = " ".join(
                f"{key.split('.')[-1]}={span.attributes[key]}" for key in shown if key in span.attributes
            )
            events = f" events: {', '.join(span.events)}" if span.events else ""
            lines.append(
                f"{'  ' * depth}{span.name}  [{span.service}]  +{start:.1f} ms, {took:.1f} ms  {notes}{events}"
            )
            walk(span.span_id, depth + 1)

    walk("", 0)
    return "\n".join(line.rstrip() for line in lines)
