"""Claims and leases of the worker registry on a real Redis: a server or worker writes only keys it still holds,
even when another one takes the key between its check and its write."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from harness.waiting import wait_for
from server.workers.protocol import WorkerInfo
from server.workers.registry import (
    Directory,
    Registration,
    WorkerRecord,
    claim_key,
    events_key,
    registration_lease_key,
    registrations_key,
)
from server.workers.transport import ChannelAddress

MODEL = "step"


def record(worker_id: str, pid: int = 1) -> WorkerRecord:
    address = ChannelAddress.tcp("127.0.0.1", 5555)
    return WorkerRecord(worker_id, address, WorkerInfo(MODEL, 256, 200, 4, 7, pid))


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def directories(redis_url: str) -> Iterator[tuple[Directory, Directory]]:
    """Two servers' directories of one model, with a 5 s claim lease (tests lapse claims with PEXPIRE)."""
    pair = (Directory(redis_url, MODEL, lease_s=5.0), Directory(redis_url, MODEL, lease_s=5.0))
    yield pair
    for directory in pair:
        directory.close()


def lapse(client: redis.Redis, key: str) -> None:
    """Let `key` run out now, as a lease does whose holder stopped renewing it."""
    client.pexpire(key, 1)
    wait_for(lambda: not client.exists(key), 10.0, 0.002, what=f"{key} to expire")


def taken_after_next_command(owner_client: redis.Redis, other: redis.Redis, key: str, new_owner: str) -> None:
    """Right after the next command `owner_client` sends, its lease on `key` lapses and `new_owner` takes it:
    the worst moment for a release that checks the owner and then deletes in a second command."""
    send = owner_client.execute_command

    def execute_command(*args, **options):
        try:
            return send(*args, **options)
        finally:
            del owner_client.execute_command  # once: back to the class's method
            other.set(key, new_owner, px=5000)

    owner_client.execute_command = execute_command


def test_a_server_releasing_a_claim_another_server_just_took_leaves_it(directories, client) -> None:
    first, second = directories
    key = claim_key(MODEL, "w1")
    assert first.claim("w1")
    taken_after_next_command(first._link.client, client, key, second.server_id)
    first.release("w1")
    assert client.get(key) == second.server_id.encode()


def test_a_worker_freeing_a_lapsed_servers_claim_leaves_the_next_servers(
    redis_url, directories, client
) -> None:
    first, second = directories
    key = claim_key(MODEL, "w1")
    assert first.claim("w1")
    registration = Registration(redis_url, record("w1"))
    try:
        taken_after_next_command(registration._link.client, client, key, second.server_id)
        registration.release_claim(first.server_id)  # the first server went silent
    finally:
        registration._link.close()
    assert client.get(key) == second.server_id.encode()


def test_keep_claims_leaves_a_claim_another_server_took_after_a_lapse_and_reports_it(
    directories, client, caplog
) -> None:
    first, second = directories
    assert first.claim("w1") and first.claim("w2")
    lapse(client, claim_key(MODEL, "w1"))  # e.g. this server was cut off from Redis longer than the lease
    assert second.claim("w1")
    assert first.keep_claims(["w1", "w2"]) == ["w1"]
    assert client.get(claim_key(MODEL, "w1")) == second.server_id.encode()
    assert client.get(claim_key(MODEL, "w2")) == first.server_id.encode()
    assert "worker w1" in caplog.text and "another server" in caplog.text


def test_keep_claims_renews_retakes_a_free_lapsed_claim_and_release_frees_it(directories, client) -> None:
    first, second = directories
    assert first.claim("w1") and first.claim("w2") and not second.claim("w1")
    client.pexpire(claim_key(MODEL, "w1"), 200)
    lapse(client, claim_key(MODEL, "w2"))  # nobody took it meanwhile: this server, still attached, keeps it
    assert first.keep_claims(["w1", "w2"]) == []
    for worker_id in ("w1", "w2"):
        assert client.get(claim_key(MODEL, worker_id)) == first.server_id.encode()
        assert client.pttl(claim_key(MODEL, worker_id)) > 4000
    second.release("w1")  # not the holder: changes nothing
    assert client.exists(claim_key(MODEL, "w1"))
    first.release("w1")
    assert not client.exists(claim_key(MODEL, "w1")) and second.claim("w1")


@pytest.fixture
def registration(redis_url: str) -> Iterator[Registration]:
    """Worker w1, registered with a 0.3 s lease (renewed every 0.1 s)."""
    registered = Registration(redis_url, record("w1"), lease_s=0.3)
    registered.register()
    yield registered
    registered.deregister("test over")


def test_a_worker_lease_another_worker_took_after_a_lapse_is_not_overwritten(
    registration, client, caplog
) -> None:
    lease = registration_lease_key(MODEL, "w1")
    client.set(lease, b"successor-token", px=5000)  # w1's lease lapsed and a new w1 registered meanwhile
    client.hset(registrations_key(MODEL), "w1", record("w1", pid=2).to_json())
    wait_for(
        lambda: "another worker" in caplog.text or client.get(lease) != b"successor-token",
        2.0,
        0.01,
        what="a lease renewal",
    )
    assert client.get(lease) == b"successor-token"
    assert WorkerRecord.from_json("w1", client.hget(registrations_key(MODEL), "w1")).info.pid == 2
    assert "worker w1" in caplog.text


def test_a_worker_leaving_after_another_took_its_id_leaves_that_ones_registration(
    registration, client
) -> None:
    lease = registration_lease_key(MODEL, "w1")
    client.set(lease, b"successor-token", px=5000)
    client.hset(registrations_key(MODEL), "w1", record("w1", pid=2).to_json())
    registration.deregister("shutting down")
    assert client.get(lease) == b"successor-token" and client.hexists(registrations_key(MODEL), "w1")
    assert client.xrevrange(events_key(MODEL), count=1)[0][1][b"event"] == b"join"  # no "leave" for it


def test_a_worker_renews_its_lease_registers_again_after_a_free_lapse_and_leaves(
    registration, client, caplog
) -> None:
    lease = registration_lease_key(MODEL, "w1")
    client.pexpire(lease, 50)
    wait_for(lambda: client.pttl(lease) > 100, 10.0, 0.01, what="the lease renewed")
    client.hdel(registrations_key(MODEL), "w1")  # a server saw the lease gone and removed the registration,
    client.delete(lease)  # which had lapsed (deleted here: an expiry could race the next renewal)
    wait_for(  # the record is written before the log line: wait for both
        lambda: client.hexists(registrations_key(MODEL), "w1") and "registered again" in caplog.text,
        10.0, 0.01, what="w1 registered again",
    )  # fmt: skip
    registration.deregister("shutting down")
    assert not client.exists(lease) and not client.hexists(registrations_key(MODEL), "w1")
    assert client.xrevrange(events_key(MODEL), count=1)[0][1][b"event"] == b"leave"
