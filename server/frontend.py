"""Runs the OpenAI-compatible FastAPI app with uvicorn in a background thread of `strata serve`."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Mapping

import uvicorn
from prometheus_client import CollectorRegistry

from server.engine.api import Engine
from server.openai.app import build_app
from server.openai.embedder import Embedder
from server.openai.limits import RequestLimits
from server.openai.metrics import FrontendMetrics
from server.openai.observe import CORSSettings
from server.openai.response_store import ResponseStore

log = logging.getLogger(__name__)


class OpenAIFrontend:
    def __init__(
        self,
        engines: Mapping[str, Engine],
        address: str,
        port: int,
        registry: CollectorRegistry,
        api_key: str | None = None,
        ssl_keyfile: str | None = None,
        ssl_certfile: str | None = None,
        limits: RequestLimits | None = None,
        tool_call_parser: str | None = None,
        response_store: ResponseStore | None = None,
        embedders: Mapping[str, Embedder] | None = None,
        access_log: bool = True,
        cors: CORSSettings | None = None,
    ) -> None:
        """`api_key`: bearer key on /v1/* (vLLM's --api-key); `ssl_*`: serve HTTPS (vLLM's --ssl-keyfile/certfile);
        `limits`: per-request bounds (--max-request-bytes, --max-n, ...); `tool_call_parser`: tool_choice auto's
        parser (--tool-call-parser with --enable-auto-tool-choice; None refuses auto); `response_store`: where
        /v1/responses keeps responses (None: this process's memory); `embedders`: the repository's embedding models
        (a live view) for /v1/embeddings; `access_log`, `cors`: server/openai/observe.py."""
        app = build_app(
            engines,
            FrontendMetrics.create(registry),
            api_key=api_key,
            limits=limits,
            tool_call_parser=tool_call_parser,
            response_store=response_store,
            embedders=embedders,
            access_log=access_log,
            cors=cors,
        )
        config = uvicorn.Config(
            app,
            host=address,
            port=port,
            log_level="warning",
            access_log=False,
            ssl_keyfile=ssl_keyfile,
            ssl_certfile=ssl_certfile,
        )
        self._server = uvicorn.Server(config)
        self._address = address
        self._tls = ssl_certfile is not None
        self.port = port
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind the port here (so a taken port fails now, naming it) and serve from a thread."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self._address, self.port))
        listener.listen(1024)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [listener]}, name="openai-frontend", daemon=True
        )
        self._thread.start()
        log.info("OpenAI frontend on port %d (%s)", self.port, "https" if self._tls else "http")

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
