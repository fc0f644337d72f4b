"""A small HTTP server for status routes (metrics, health) on a thread of its own: the metrics port of
`strata serve` (server/metrics_endpoint.py) and the one of `strata worker` (server/workers/status.py).

Each route is a function that returns (HTTP status, body, content type); anything else is a 404. Handlers run on
their own threads (one per connection), never on an engine's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

Route = Callable[[], tuple[int, bytes, str]]  # -> (status, body, content type)


class StatusServer:
    def __init__(self, address: str, port: int, routes: Mapping[str, Route], name: str) -> None:
        """Bind `address:port` now (OSError if taken; port 0: any free one, see `port`); serve from `start`."""
        self._server = ThreadingHTTPServer((address, port), _handler(routes))
        self._server.daemon_threads = True
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


def _handler(routes: Mapping[str, Route]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            route = routes.get(self.path.split("?", 1)[0])
            if route is None:
                self.send_error(404, f"not found; this port serves {', '.join(sorted(routes))}")
                return
            try:
                status, body, content_type = route()
            except Exception:
                log.exception("status route %s failed", self.path)
                status, body, content_type = 500, b"internal error\n", "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # probes and scrapes: no log line each
            return

    return Handler
