"""Leases and claims in Redis: keys whose value names their owner, renewed and released only by that owner.

Each check of the owner and the write that follows it is one Lua script, which Redis runs atomically: another
owner that takes the key between a plain GET and the DEL or SET after it would lose its key (deleted, or
overwritten). Taking a key is a plain `SET key owner NX PX ttl`, atomic as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import redis

# KEYS: the leases. ARGV: the owner's value, the time to live (ms). One LeaseState per key.
_RENEW = """
local states = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('PEXPIRE', key, ARGV[2])
    states[i] = 1
  elseif redis.call('SET', key, ARGV[1], 'NX', 'PX', ARGV[2]) then
    states[i] = 2
  else
    states[i] = 0
  end
end
return states
"""

# KEYS: the lease. ARGV: the owner's value. 1 if it was the owner's and is gone, else 0.
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class LeaseState(IntEnum):
    """What renewing did to one lease."""

    HELD_BY_OTHER = 0  # another owner holds it: left as it is
    RENEWED = 1  # it was ours: its time to live starts again
    TAKEN = 2  # it had lapsed (or never existed) and nobody held it: ours now


class Leases:
    """The owner-checked writes on one Redis client. Raises what redis-py raises (callers go through
    `RedisLink.call`)."""

    def __init__(self, client: redis.Redis) -> None:
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    def renew(self, keys: Sequence[str | bytes], owner: str, ttl_ms: int) -> list[LeaseState]:
        """Extend each key that `owner` holds to `ttl_ms` and take each free one; never touch another's."""
        if not keys:
            return []
        return [LeaseState(state) for state in self._renew(keys=list(keys), args=[owner, ttl_ms])]

    def release(self, key: str | bytes, owner: str) -> bool:
        """Delete `key` if `owner` still holds it; True if it did."""
        return bool(self._release(keys=[key], args=[owner]))
