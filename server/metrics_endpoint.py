"""The metrics port (`--metrics-port`, 8002): Triton's nv_* series and Strata's own on one Prometheus endpoint.

Triton serves its series on a loopback port of its own; each `GET /metrics` here reads them (bounded by
`TRITON_SCRAPE_TIMEOUT_S`) and appends Strata's registry (LLM pool and queues, router, KVBM, planner), so a
scraper configured for tritonserver sees every series, with or without the OpenAI frontend. When Triton's part
cannot be read, the scrape still answers with Strata's, and a comment line says what is missing.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

TRITON_SCRAPE_TIMEOUT_S = 2.0


class MetricsEndpoint:
    def __init__(self, address: str, port: int, registry: CollectorRegistry, triton_metrics_url: str) -> None:
        """Bind `address:port` now (OSError if taken); serve from `start` until `close`."""
        self.registry = registry
        self.triton_metrics_url = triton_metrics_url
        self._server = ThreadingHTTPServer((address, port), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="strata-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def scrape(self) -> bytes:
        """Triton's exposition, then Strata's."""
        return self._triton_part() + generate_latest(self.registry)

    def _triton_part(self) -> bytes:
        try:
            with urllib.request.urlopen(self.triton_metrics_url, timeout=TRITON_SCRAPE_TIMEOUT_S) as reply:
                text = reply.read()
        except OSError as err:
            log.warning("Triton's metrics at %s not read: %s", self.triton_metrics_url, err)
            return f"# Triton's series are missing from this scrape: {err}\n".encode()
        return text if text.endswith(b"\n") or not text else text + b"\n"

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


def _handler(endpoint: MetricsEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served on this port")
                return
            body = endpoint.scrape()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # scrapes are not worth a log line each
            return

    return Handler
