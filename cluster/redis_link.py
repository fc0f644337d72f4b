"""A Redis connection that never raises into the caller: while Redis is down, calls return a default at once
and one reconnect attempt is made per backoff period (0.25 s doubling to 8 s), so there is no busy loop."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import redis

from cluster.backoff import Backoff

log = logging.getLogger(__name__)
T = TypeVar("T")

MIN_BACKOFF_S = 0.25
MAX_BACKOFF_S = 8.0


class UpGauge(Protocol):
    """Where the link reports whether Redis answered: 1 after a call that reached it, 0 after one that did not
    (a Prometheus Gauge, such as the KVBM's `kvbm_redis_up`)."""

    def set(self, value: float) -> None: ...


class RedisLink:
    """Invariant: `call` returns `fn(client)` or `default`; Redis and socket errors are logged, never raised."""

    def __init__(
        self,
        url: str,
        up_gauge: UpGauge | None = None,
        timeout_s: float = 2.0,
        connect_timeout_s: float = 0.25,
    ) -> None:
        """`timeout_s` bounds one socket read (a large MGET reply streams in many); `connect_timeout_s` bounds how
        long the engine thread can stall on an unreachable host once per backoff period."""
        self.url = url
        self.up_gauge = up_gauge
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s, health_check_interval=0
        )
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._backoff = Backoff(MIN_BACKOFF_S, MAX_BACKOFF_S)
        self._up = True

    @property
    def up(self) -> bool:
        return self._up

    def call(self, fn: Callable[[redis.Redis], T], default: T) -> T:
        if not self._up and time.monotonic() < self._retry_at:
            return default
        try:
            result = fn(self.client)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as err:
            self._mark_down(err)
            return default
        except redis.RedisError as err:
            log.warning("redis %s: command failed: %s", self.url, err)
            return default
        self._mark_up()
        return result

    def _mark_down(self, err: Exception) -> None:
        with self._lock:
            if self._up:
                log.warning("redis %s unreachable (%s); skipping it, retrying with backoff", self.url, err)
                self._backoff.reset()
            else:
                self._backoff.grow()
            self._up = False
            self._retry_at = time.monotonic() + self._backoff.delay
        self.client.connection_pool.disconnect()
        if self.up_gauge is not None:
            self.up_gauge.set(0)

    def _mark_up(self) -> None:
        if not self._up:
            with self._lock:
                self._up = True
                self._backoff.reset()
            log.info("redis %s reachable again", self.url)
        if self.up_gauge is not None:
            self.up_gauge.set(1)

    def close(self) -> None:
        self.client.close()
