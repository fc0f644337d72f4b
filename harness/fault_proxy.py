"""A TCP proxy in front of a real server that can fail on demand: what a flaky network or an overloaded object
store does to a client, without restarting the server behind it (SeaweedFS takes seconds to come back).

    proxy = FaultProxy(target_port); proxy.start()      # clients use proxy.port
    proxy.mode = "pass"      bytes go through both ways
    proxy.mode = "refuse"    connections are accepted and closed at once (the peer sees a reset)
    proxy.mode = "stall"     connections are accepted and never answered (the client's timeout decides)
    proxy.mode = "throttle"  every HTTP request is answered 503 SlowDown, as S3 answers when throttling

Setting a mode closes the connections open under the previous one (clients pool them).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Literal

from harness.ports import free_port

Mode = Literal["pass", "refuse", "stall", "throttle"]
_SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>\n"
)
SLOW_DOWN = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n" % len(_SLOW_DOWN_BODY) + _SLOW_DOWN_BODY
)


class FaultProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.port = free_port()
        self._target = (target_host, target_port)
        self._mode: Mode = "pass"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def mode(self) -> Mode:
        return self._mode

    @mode.setter
    def mode(self, mode: Mode) -> None:
        self._mode = mode
        asyncio.run_coroutine_threadsafe(self._drop_all(), self._loop).result(5)

    def start(self) -> None:
        self._thread.start()
        serve = asyncio.start_server(self._client, "127.0.0.1", self.port)
        self._server = asyncio.run_coroutine_threadsafe(serve, self._loop).result(5)

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            await self._drop_all()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _drop_all(self) -> None:
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            if self._mode == "refuse":
                return
            if self._mode == "stall":
                await reader.read()  # until the client gives up
                return
            if self._mode == "throttle":
                await reader.readuntil(b"\r\n\r\n")
                writer.write(SLOW_DOWN)
                await writer.drain()
                return
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
            self._writers.add(upstream_writer)
            await asyncio.gather(
                self._pipe(reader, upstream_writer),
                self._pipe(upstream_reader, writer),
                return_exceptions=True,
            )
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self._writers.discard(writer)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        writer.close()
