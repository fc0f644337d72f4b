"""cluster.redis_lease on a real Redis: each key is renewed or released only by the owner its value names."""

from __future__ import annotations

import redis

from cluster.redis_lease import Leases, LeaseState


def test_renew_extends_its_own_takes_free_ones_and_leaves_anothers(redis_url) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set("ours", "a", px=100)
    client.set("theirs", "b", px=5000)
    states = Leases(client).renew(["ours", "free", "theirs"], "a", 3000)
    assert states == [LeaseState.RENEWED, LeaseState.TAKEN, LeaseState.HELD_BY_OTHER]
    assert client.mget("ours", "free", "theirs") == [b"a", b"a", b"b"]
    assert client.pttl("ours") > 2000 and client.pttl("free") > 2000 and client.pttl("theirs") <= 5000
    assert Leases(client).renew([], "a", 3000) == []


def test_release_deletes_only_its_own(redis_url) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set("lease", "b", px=5000)
    leases = Leases(client)
    assert not leases.release("lease", "a") and client.get("lease") == b"b"
    assert leases.release("lease", "b") and not client.exists("lease")
    assert not leases.release("lease", "b")
