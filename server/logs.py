"""Where a Strata process logs and in what shape: `--log-file` (default: stderr) and `--log-format text|json`.

JSON lines carry, besides the time, level, logger and message, the HTTP request id of the request being served
(`REQUEST_ID`, set by the OpenAI port's middleware, server/openai/observe.py) and, while tracing, the trace and span
ids of the current span, so that a log line and its trace are found from each other. Worker processes log the
same way (their `LogSettings` travel in their spec), with their worker id as `process`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextvars import ContextVar
from typing import Literal

import msgspec

# the id of the HTTP request whose code is running (set by server/openai/observe.py), for the JSON log lines
REQUEST_ID: ContextVar[str | None] = ContextVar("strata_request_id", default=None)


class LogSettings(msgspec.Struct, frozen=True):
    """--log-file (None: stderr) and --log-format."""

    file: str | None = None
    format: Literal["text", "json"] = "text"


def configure_logging(settings: LogSettings, level: int, process: str) -> None:
    """Log this process's records at `level` and above as `settings` say; `process` names it in each line
    (server, worker-0, ...). Replaces the handler a previous call installed. Like logging.basicConfig, the default
    settings leave alone a root logger that a host program (a test runner) configured."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "strata", False)]
    if settings == LogSettings() and len(ours) < len(root.handlers):
        return
    handler = (
        logging.FileHandler(settings.file, encoding="utf-8") if settings.file else logging.StreamHandler()
    )
    handler.strata = True  # type: ignore[attr-defined]
    if settings.format == "json":
        handler.setFormatter(JSONFormatter(process))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {process}[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
        )
    for old in ours:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)


class JSONFormatter(logging.Formatter):
    """One JSON object per record: ts (RFC 3339, UTC), level, logger, message, process, pid, and when known
    request_id, trace_id, span_id; an exception's traceback as `exception`."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": self.process,
            "pid": record.process,
        }
        request_id = REQUEST_ID.get()
        if request_id is not None:
            line["request_id"] = request_id
        line.update(_trace_ids())
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def _trace_ids() -> dict[str, str]:
    from server import tracing

    if not tracing.enabled():
        return {}
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}
