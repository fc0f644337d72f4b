"""Where the Responses API keeps stored responses: one process's memory, or Redis shared by every frontend replica.

A stored response is JSON (the response object and the conversation it ends, as chat turns: responses.py), so
nothing that crosses a process can carry code. Both stores bound what they hold: entries expire `ttl_s` after they
were written, and past `max_entries` the oldest go first. vLLM keeps responses in one process's memory only, so a
conversation continued with `previous_response_id` breaks as soon as a second replica answers; with `--redis-url`
every replica reads the same store.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from typing import Any, Protocol

import redis.asyncio as aioredis

StoredResponse = dict[
    str, Any
]  # {"response": the response, "turns": the conversation as chat turns, "input_items"}


class ResponseStore(Protocol):
    async def put(self, response_id: str, stored: StoredResponse) -> None: ...

    async def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None if there is none (never stored, expired, deleted or evicted)."""
        ...

    async def delete(self, response_id: str) -> bool:
        """Forget the response; False if there was none."""
        ...

    async def close(self) -> None: ...


class MemoryResponseStore:
    """This process's store (the default without --redis-url): an LRU of at most `max_entries`, each kept `ttl_s`."""

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (expires at, JSON)

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        self._entries[response_id] = (time.monotonic() + self.ttl_s, json.dumps(stored))
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        expires_at, text = entry
        if time.monotonic() >= expires_at:
            del self._entries[response_id]
            return None
        self._entries.move_to_end(response_id)
        return json.loads(text)  # a copy: the caller may change it

    async def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    async def close(self) -> None:
        self._entries.clear()


class RedisResponseStore:
    """Responses in Redis (--redis-url), shared by every frontend: a key per response with `ttl_s` (Redis expires
    it), and a sorted set of ids by write time that trims the oldest past `max_entries`.

    The client is made on first use, in the event loop that uses it (the frontend's uvicorn thread)."""

    def __init__(self, url: str, ttl_s: float, max_entries: int, prefix: str = "strata:responses") -> None:
        self.url = url
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._prefix = prefix
        self._index = f"{prefix}:index"
        self._client: aioredis.Redis | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _redis(self) -> aioredis.Redis:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client, self._loop = aioredis.Redis.from_url(self.url), loop
        return self._client

    def _key(self, response_id: str) -> str:
        return f"{self._prefix}:{response_id}"

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        redis = self._redis()
        async with redis.pipeline(transaction=True) as pipe:
            pipe.set(self._key(response_id), json.dumps(stored), px=max(1, int(self.ttl_s * 1000)))
            pipe.zadd(self._index, {response_id: time.time()})
            pipe.zremrangebyscore(self._index, "-inf", time.time() - self.ttl_s)  # ids whose keys expired
            pipe.zcard(self._index)
            *_, count = await pipe.execute()
        if count > self.max_entries:
            oldest = await redis.zpopmin(self._index, count - self.max_entries)
            if oldest:
                await redis.delete(*(self._key(member.decode()) for member, _ in oldest))

    async def get(self, response_id: str) -> StoredResponse | None:
        text = await self._redis().get(self._key(response_id))
        return None if text is None else json.loads(text)

    async def delete(self, response_id: str) -> bool:
        redis = self._redis()
        async with redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(response_id))
            pipe.zrem(self._index, response_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
