from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kvbm_testing import RedisServer, small_layout

from server.engine.kv_connector import KVLayout


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture
def layout() -> KVLayout:
    return small_layout()


@pytest.fixture
def cache_id() -> Iterator[str]:
    """A unique G2 segment name; the segment is removed after the test."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    for path in Path("/dev/shm").glob(f"strata-kvbm-{name}-*"):
        path.unlink(missing_ok=True)
