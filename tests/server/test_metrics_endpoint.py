"""server/metrics_endpoint.py: the metrics port answers Triton's series and Strata's in one scrape, and Strata's
alone (with a comment saying so) when Triton's cannot be read."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Gauge

from harness.ports import free_port
from server.metrics_endpoint import MetricsEndpoint

TRITON_TEXT = b'# TYPE nv_inference_count counter\nnv_inference_count{model="m",version="1"} 3\n'


class _Triton(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.end_headers()
        self.wfile.write(TRITON_TEXT)

    def log_message(self, *args) -> None:
        return


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Gauge("strata_example", "one of Strata's series", registry=registry).set(7)
    return registry


def _scrape(port: int, path: str = "/metrics") -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10).read().decode()


def test_one_scrape_holds_tritons_series_then_stratas(registry) -> None:
    triton = ThreadingHTTPServer(("127.0.0.1", 0), _Triton)
    threading.Thread(target=triton.serve_forever, daemon=True).start()
    port = free_port()
    endpoint = MetricsEndpoint("127.0.0.1", port, registry, f"http://127.0.0.1:{triton.server_port}/metrics")
    endpoint.start()
    try:
        text = _scrape(port)
        assert text.startswith(TRITON_TEXT.decode()) and "\nstrata_example 7.0\n" in text
        with pytest.raises(urllib.error.HTTPError) as missing:
            _scrape(port, "/v2/health/ready")
        assert missing.value.code == 404
    finally:
        endpoint.close()
        triton.shutdown()
        triton.server_close()


def test_without_triton_the_scrape_has_stratas_series_and_says_what_is_missing(registry) -> None:
    port = free_port()
    endpoint = MetricsEndpoint("127.0.0.1", port, registry, f"http://127.0.0.1:{free_port()}/metrics")
    endpoint.start()
    try:
        text = _scrape(port)
        assert text.startswith("# Triton's series are missing from this scrape:")
        assert "\nstrata_example 7.0\n" in text
    finally:
        endpoint.close()
