"""The metrics port (`--metrics-port`, 8002): Triton's nv_* series and Strata's own on one Prometheus endpoint.

Triton serves its series on a loopback port of its own; each `GET /metrics` here reads them (bounded by
`TRITON_SCRAPE_TIMEOUT_S`) and appends Strata's registry (LLM pool and queues, router, KVBM, planner), so a
scraper configured for tritonserver sees every series, with or without the OpenAI frontend. When Triton's part
cannot be read, the scrape still answers with Strata's, and a comment line says what is missing.
"""

from __future__ import annotations

import logging
import urllib.request

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from server.status_http import StatusServer

log = logging.getLogger(__name__)

TRITON_SCRAPE_TIMEOUT_S = 2.0


class MetricsEndpoint:
    def __init__(self, address: str, port: int, registry: CollectorRegistry, triton_metrics_url: str) -> None:
        """Bind `address:port` now (OSError if taken); serve from `start` until `close`."""
        self.registry = registry
        self.triton_metrics_url = triton_metrics_url
        self._server = StatusServer(address, port, {"/metrics": self._metrics}, "strata-metrics")

    def start(self) -> None:
        self._server.start()

    def close(self) -> None:
        self._server.close()

    def scrape(self) -> bytes:
        """Triton's exposition, then Strata's."""
        return self._triton_part() + generate_latest(self.registry)

    def _metrics(self) -> tuple[int, bytes, str]:
        return 200, self.scrape(), CONTENT_TYPE_LATEST

    def _triton_part(self) -> bytes:
        try:
            with urllib.request.urlopen(self.triton_metrics_url, timeout=TRITON_SCRAPE_TIMEOUT_S) as reply:
                text = reply.read()
        except OSError as err:
            log.warning("Triton's metrics at %s not read: %s", self.triton_metrics_url, err)
            return f"# Triton's series are missing from this scrape: {err}\n".encode()
        return text if text.endswith(b"\n") or not text else text + b"\n"
