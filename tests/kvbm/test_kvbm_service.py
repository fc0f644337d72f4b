"""The standalone KVBM service over a real Redis: events over the Stream, queries over its port, leases, restart
rebuild. The query link itself (CURVE, refusals, timeouts): test_kvbm_query_port.py."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from kvbm_testing import (
    BLOCK_KEY,
    CLUSTER_SECRET,
    LEASE_TTL_S,
    ZMTP_SIGNATURE,
    make_kv_cache,
    old_style_query,
    read_until_closed,
    small_layout,
    spawned_offload,
)

from harness.redis_server import RedisServer
from harness.waiting import wait_for
from kvbm.agent import build_connector
from kvbm.api import BlockRemoved, BlockStored
from kvbm.block_hash import BlockHash
from kvbm.channel import STREAM
from kvbm.client import KVIndexClient
from kvbm.config import GIB, KVBMConfig
from kvbm.connector import KVBMConnector
from kvbm.events import G1, G2, TierEvent
from kvbm.index import WorkerPrefix
from kvbm.service import KVBMService
from kvbm.wire import service_keys
from server.router.config import RouterConfig
from server.router.cost import SharedPrefix, blocks_to_prefill

SPAWN = multiprocessing.get_context("spawn")
SERVICE_KEYS = service_keys(CLUSTER_SECRET)
BLOCKS = [BlockHash(h) for h in range(1, 9)]


LEASE_CHECK_S = 0.2  # how often the service looks for expired leases

# What these tests wait for reaches the service through Redis (another process) and the service's follower thread:
# there is no event to wait on, so they poll the index with harness.waiting.wait_for and a deadline.


@pytest.fixture
def service(redis_url: str) -> Iterator[KVBMService]:
    running = KVBMService(redis_url, port=0, lease_check_s=LEASE_CHECK_S, keys=SERVICE_KEYS).start()
    yield running
    running.stop()


@pytest.fixture
def worker(redis_url: str, cache_id: str) -> Iterator[KVBMConnector]:
    config = KVBMConfig(
        cache_id=cache_id, host_cache_gb=64 * 1024 / GIB, redis_url=redis_url, block_key=BLOCK_KEY
    )
    connector = build_connector(config, "worker-a", lease_ttl_s=LEASE_TTL_S)
    connector.bind(make_kv_cache(small_layout(), 64), small_layout())
    connector.offload(BLOCKS, list(range(8)))
    for block_hash in BLOCKS[:4]:
        connector.on_event(BlockStored(block_hash, None, (0, 0, 0, 0)))
    yield connector
    connector.close()


def holds(
    service: KVBMService, worker_id: str, prefix: WorkerPrefix, hashes: list[BlockHash] = BLOCKS
) -> Callable[[], bool]:
    return lambda: service.index.query(hashes).workers.get(worker_id) == prefix


def test_events_reach_the_service_and_client_queries_it(service: KVBMService, worker: KVBMConnector) -> None:
    wait_for(holds(service, "worker-a", WorkerPrefix(4, 8, 8)), 5, what="worker-a in the index")
    client = KVIndexClient(f"{service.address[0]}:{service.address[1]}", SERVICE_KEYS)
    assert client.query(BLOCKS) == service.index.query(BLOCKS)
    assert client.query([]).num_blocks == 0
    client.close()


def test_dead_worker_vanishes_within_seconds(service: KVBMService, redis_url: str, cache_id: str) -> None:
    done = SPAWN.Queue()
    config = dict(cache_id=cache_id, host_cache_gb=64 * 1024 / GIB, redis_url=redis_url)
    child = SPAWN.Process(target=spawned_offload, args=(config, "worker-b", 1, 8, done, True))
    child.start()
    try:
        assert done.get(timeout=120) == "worker-b"
        wait_for(holds(service, "worker-b", WorkerPrefix(0, 8, 8)), 5, what="worker-b in the index")
        os.kill(child.pid, signal.SIGKILL)
        took = wait_for(lambda: "worker-b" not in service.index.workers, 10, what="worker-b to expire")
        # the time is the contract: gone once its lease runs out and the next check comes; twice that bounds it
        assert took < 2 * (LEASE_TTL_S + LEASE_CHECK_S)
        assert service.index.query(BLOCKS).workers == {}
    finally:
        child.kill()
        child.join(timeout=10)


def test_restarted_service_rebuilds_from_the_stream(redis_url: str, worker: KVBMConnector) -> None:
    first = KVBMService(redis_url, port=None, lease_check_s=LEASE_CHECK_S).start()
    wait_for(holds(first, "worker-a", WorkerPrefix(4, 8, 8)), 5, what="first service to see worker-a")
    first.stop()
    second = KVBMService(redis_url, port=None, lease_check_s=LEASE_CHECK_S).start()
    try:
        wait_for(holds(second, "worker-a", WorkerPrefix(4, 8, 8)), 5, what="replay into the second service")
    finally:
        second.stop()


def test_workers_reannounce_when_the_stream_was_lost(redis_url: str, worker: KVBMConnector) -> None:
    worker.events.flush()  # type: ignore[union-attr]
    redis.Redis.from_url(redis_url).delete(STREAM)
    service = KVBMService(redis_url, port=None, lease_check_s=LEASE_CHECK_S).start()
    try:
        wait_for(lambda: worker._announce_due, 5, what="worker to notice the new service epoch")
        worker.lookup([])  # the next engine-thread call re-announces
        wait_for(holds(service, "worker-a", WorkerPrefix(4, 8, 8)), 5, what="re-announced blocks")
    finally:
        service.stop()


def test_service_process_answers_queries(redis_url: str, worker: KVBMConnector) -> None:
    """`python -m kvbm` (what `strata kvbm` runs) as a real process, queried with KVIndexClient, stopped by SIGTERM."""

    from harness.ports import free_port

    port = free_port()
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [sys.executable, "-m", "kvbm", "--redis-url", redis_url, "--port", str(port)],
        cwd=root,
        env={**os.environ, "STRATA_CLUSTER_SECRET": CLUSTER_SECRET.decode()},
    )
    client = KVIndexClient(f"127.0.0.1:{port}", SERVICE_KEYS)

    def answered() -> bool:
        try:
            return client.query(BLOCKS).workers.get("worker-a") == WorkerPrefix(4, 8, 8)
        except OSError:
            return False

    try:
        wait_for(answered, 30, what="the kvbm process to answer")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        client.close()
        process.kill()
        process.wait(timeout=10)


def test_object_tier_blocks_reach_the_index_outlive_their_worker_and_are_priced_at_g5s_cost(
    service: KVBMService, redis_url: str, cache_id: str, object_url: str
) -> None:
    """G5 through the standalone service: a worker with G2 and a bucket (no write-through, so nothing in G4)
    offloads 8 blocks; once uploaded they are in the index as shared G5 blocks that every worker can onboard, still
    after the worker and its G2 are gone, and the router prices a worker with none of them in G1-G3 at
    onboard_cost_g5 per block, not a prefill."""
    config = KVBMConfig(
        cache_id=cache_id,
        host_cache_gb=64 * 1024 / GIB,
        redis_url=redis_url,
        object_url=object_url,
        block_key=BLOCK_KEY,
    )
    connector = build_connector(config, "worker-g5", lease_ttl_s=LEASE_TTL_S)
    try:
        connector.bind(make_kv_cache(small_layout(), 64), small_layout())
        connector.offload(BLOCKS, list(range(8)))

        def published() -> bool:
            connector.lookup([])  # the engine thread publishes the uploads G5 finished
            return service.index.query(BLOCKS).g5 == len(BLOCKS)

        wait_for(published, 30, what="the uploaded blocks in the index")
    finally:
        connector.close()
    wait_for(lambda: "worker-g5" not in service.index.workers, 10, what="worker-g5 to leave the index")
    client = KVIndexClient(f"{service.address[0]}:{service.address[1]}", SERVICE_KEYS)
    try:
        report = client.query(BLOCKS)
    finally:
        client.close()
    assert (report.g4, report.g5, report.workers) == (0, len(BLOCKS), {})
    shared, router = SharedPrefix.of(report), RouterConfig()
    assert blocks_to_prefill(len(BLOCKS), None, shared, router) == pytest.approx(
        len(BLOCKS) * router.onboard_cost_g5
    )
    assert blocks_to_prefill(len(BLOCKS), None, SharedPrefix.of(None), router) == len(BLOCKS)


def test_client_reports_the_service_event_count(service: KVBMService, worker: KVBMConnector) -> None:
    wait_for(holds(service, "worker-a", WorkerPrefix(4, 8, 8)), 5, what="worker-a in the index")
    client = KVIndexClient(f"{service.address[0]}:{service.address[1]}", SERVICE_KEYS)
    assert client.events_applied == 0
    client.query(BLOCKS)
    assert client.events_applied == service.index.events_applied > 0
    client.close()


def test_index_recovers_after_redis_restart_loses_everything(cache_id: str) -> None:
    server = RedisServer()
    server.start()
    config = KVBMConfig(
        cache_id=cache_id, host_cache_gb=64 * 1024 / GIB, redis_url=server.url, block_key=BLOCK_KEY
    )
    connector = build_connector(config, "worker-r", lease_ttl_s=LEASE_TTL_S)
    connector.bind(make_kv_cache(small_layout(), 64), small_layout())
    service = KVBMService(server.url, port=None, lease_check_s=LEASE_CHECK_S).start()
    try:
        connector.offload(BLOCKS, list(range(8)))
        wait_for(holds(service, "worker-r", WorkerPrefix(0, 8, 8)), 5, what="worker-r in the index")
        server.stop()
        connector.offload([BlockHash(99)], [9])  # events are dropped while Redis is down, nothing raises
        server.start()  # empty: no stream, no leases, no epoch
        wait_for(lambda: connector._announce_due, 20, what="worker to notice Redis came back")
        connector.lookup([])  # the engine thread's next call re-announces
        # block 99 reached no index before (its event was dropped): only the re-announcement puts it there; the
        # first 8 may still be the service's pre-restart entries until it notices the new epoch
        wait_for(
            holds(service, "worker-r", WorkerPrefix(0, 1, 1), [BlockHash(99)]), 20, what="block 99 announced"
        )
        wait_for(
            holds(service, "worker-r", WorkerPrefix(0, 8, 8)),
            20,
            what="re-announced blocks after the restart",
        )
    finally:
        service.stop()
        connector.close()
        server.stop()


def test_a_client_without_the_secret_gets_no_answer_and_the_service_keeps_serving(
    service: KVBMService, worker: KVBMConnector
) -> None:
    wait_for(holds(service, "worker-a", WorkerPrefix(4, 8, 8)), 5, what="worker-a in the index")
    address = f"{service.address[0]}:{service.address[1]}"
    intruder = KVIndexClient(address, service_keys(b"not-the-cluster-secret-at-all"), timeout_s=0.5)
    with pytest.raises(TimeoutError):
        intruder.query(BLOCKS)
    intruder.close()
    registry = service.metrics.registry
    wait_for(
        lambda: registry.get_sample_value("kvbm_service_auth_failures_total") >= 1,
        5,
        what="a refusal counted",
    )
    with socket.create_connection(service.address) as raw:  # an old-style plain query: closed unanswered
        raw.sendall(old_style_query(BLOCKS))
        assert read_until_closed(raw, 5) in (b"", ZMTP_SIGNATURE)
    client = KVIndexClient(address, SERVICE_KEYS)
    assert client.query(BLOCKS).workers["worker-a"] == WorkerPrefix(4, 8, 8)
    client.close()


def test_the_service_refuses_to_start_without_a_secret(redis_url: str) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key != "STRATA_CLUSTER_SECRET"}
    result = subprocess.run(
        [sys.executable, "-m", "kvbm", "--redis-url", redis_url, "--port", "0"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "secrets.token_hex(32)" in result.stderr


def test_a_malformed_stream_entry_is_skipped_and_counted(
    service: KVBMService, worker: KVBMConnector, redis_url: str
) -> None:
    """Anyone who can write to Redis can append to the event stream: the follower skips what does not parse."""
    wait_for(holds(service, "worker-a", WorkerPrefix(4, 8, 8)), 5, what="worker-a in the index")
    client = redis.Redis.from_url(redis_url)
    client.xadd(STREAM, {b"w": b"x", b"k": b"stored", b"t": b"not-a-tier"})
    client.xadd(STREAM, {b"junk": b"\xff"})
    worker.on_event(BlockRemoved(tuple(BLOCKS[2:4])))  # a valid event after the bad ones is still applied
    wait_for(holds(service, "worker-a", WorkerPrefix(2, 8, 8)), 5, what="the event after the bad entries")
    assert service.metrics.registry.get_sample_value("kvbm_service_events_rejected_total") == 2


def test_an_out_of_range_tier_is_skipped_and_the_follower_keeps_going(
    service: KVBMService, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Entries that parse but break the event's ranges (tier 0, a move from tier 0) are logged with their stream id
    and field, counted and skipped; the follower thread goes on and applies the good entry after them."""
    caplog.set_level(logging.WARNING, logger="kvbm.service")
    good = TierEvent("worker-c", "stored", G1, tuple(BLOCKS[:2]))
    client = redis.Redis.from_url(redis_url)
    bad_id = client.xadd(STREAM, {**good.to_fields(), b"t": b"0"})
    moved = TierEvent("worker-c", "moved", G2, tuple(BLOCKS[:2]), from_tier=G1).to_fields()
    client.xadd(STREAM, {**moved, b"f": b"0"})
    client.xadd(STREAM, good.to_fields())
    wait_for(holds(service, "worker-c", WorkerPrefix(2, 2, 2)), 5, what="the good entry after the bad ones")
    assert service.metrics.registry.get_sample_value("kvbm_service_events_rejected_total") == 2
    warning = next(r.getMessage() for r in caplog.records if bad_id.decode() in r.getMessage())
    assert "$.tier" in warning, warning
    assert any("$.from_tier" in r.getMessage() for r in caplog.records), caplog.text
