"""Remote workers through a real Redis: a `RemoteWorker` process (StepEngine inside) joins a RoutedEngine that
already serves a spawned worker, takes requests, and is dropped, expired, rejoined and released as it should."""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from prometheus_client import generate_latest

from harness.waiting import wait_for
from kvbm.block_hash import block_hashes
from kvbm.index import KVIndex
from server.engine.api import GenerationOutput, GenerationRequest, RequestId, SamplingParams
from server.router.config import RouterConfig
from server.router.routed import RoutedEngine
from server.router.router import Router
from server.workers.discovery import Discovery
from server.workers.protocol import Attach, Hello, WorkerId
from server.workers.registry import (
    Directory,
    WorkerRecord,
    claim_key,
    events_key,
    registration_lease_key,
    registrations_key,
)
from server.workers.remote import RemoteEngine
from server.workers.transport import Channel
from server.workers.worker import WorkerSpec
from tests.workers.worker_fakes import CURVE, FAKE_SPEEDS, SALT, StepEngine, run_remote_step_worker

LEASE_S = 1.5


@dataclass
class Server:
    routed: RoutedEngine
    router: Router
    discovery: Discovery
    index: KVIndex


def start_server(redis_url: str, strategy: str = "round-robin") -> Server:
    """What `strata serve --accept-remote-workers` builds per model, in process: one spawned worker + discovery."""
    index = KVIndex()
    router = Router(RouterConfig(strategy=strategy), index)
    local = RemoteEngine.spawn(
        WorkerId("local"), WorkerSpec(StepEngine, (0.005,), forward_events=True), event_sink=index
    )
    routed = RoutedEngine([local], router, block_size=4, salt=SALT)

    def connect(record: WorkerRecord, server_id: str) -> RemoteEngine:
        return RemoteEngine.connect(
            WorkerId(record.worker_id),
            record.address,
            server_id,
            CURVE,
            heartbeat_timeout_s=LEASE_S,
            event_sink=index,
        )

    discovery = Discovery(Directory(redis_url, "step", lease_s=LEASE_S), routed, connect).start()
    return Server(routed, router, discovery, index)


def stop_server(server: Server) -> None:
    server.discovery.stop()
    server.routed.close()


@pytest.fixture
def server(redis_url: str) -> Iterator[Server]:
    started = start_server(redis_url)
    yield started
    stop_server(started)


@pytest.fixture
def remote_workers(redis_url: str) -> Iterator[callable]:
    """Factory: start a remote StepEngine worker process; all are killed at teardown."""
    processes: list[multiprocessing.Process] = []

    def start(worker_id: str, exit_timeout_s: float = 30.0, step_s: float = 0.005) -> multiprocessing.Process:
        process = multiprocessing.get_context("spawn").Process(
            target=run_remote_step_worker,
            args=(worker_id, redis_url, LEASE_S, step_s, exit_timeout_s),
            daemon=True,
        )
        process.start()
        processes.append(process)
        return process

    yield start
    for process in processes:
        process.kill()
        process.join(5)


def generate(routed: RoutedEngine, request_id: str, prompt: list[int]) -> GenerationOutput:
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    routed.submit(GenerationRequest(RequestId(request_id), prompt, SamplingParams(max_tokens=3)), outputs.put)
    while not (output := outputs.get(timeout=10)).finished:
        pass
    return output


def served_by(server: Server, worker_id: str) -> bool:
    return worker_id in server.router.workers


def test_remote_worker_joins_takes_requests_and_shows_its_hardware(server, remote_workers, redis_url) -> None:
    remote_workers("r1")
    wait_for(lambda: served_by(server, "r1"), 20, 0.05, what="r1 in the router")
    seeded = server.routed.membership.meter(WorkerId("r1"))  # at join
    assert seeded.prefill_tok_s == FAKE_SPEEDS.prefill_tok_s
    metrics = generate_latest(server.router.metrics.registry).decode()
    assert 'strata_worker_info{cpu_cores="' in metrics and 'worker="r1"' in metrics
    assert 'strata_worker_prefill_tokens_per_second{worker="r1"} 5000.0' in metrics
    prompts = [[1, 2, 3, i] for i in range(4)]
    outputs = [generate(server.routed, f"q{i}", prompt) for i, prompt in enumerate(prompts)]
    assert all(o.finish_reason == "length" for o in outputs)
    holders = [set(server.index.query(block_hashes(p, 4, SALT)).workers) for p in prompts]
    assert holders.count({"r1"}) == 2  # round-robin: half went to the remote worker (its events say so)
    record = Directory(redis_url, "step").record("r1")
    assert record is not None and record.info.hardware.host == os.uname().nodename
    assert record.address.to_worker.startswith("tcp://127.0.0.1:")


def test_killed_remote_worker_is_routed_around_and_its_lease_expires(
    server, remote_workers, redis_url
) -> None:
    process = remote_workers("r1")
    wait_for(lambda: served_by(server, "r1"), 20, 0.05, what="r1 in the router")
    os.kill(process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: not served_by(server, "r1"), 10, 0.05, what="r1 dropped")
    # the contract: dropped once its heartbeats stop for heartbeat_timeout_s (= LEASE_S); twice that allows for
    # the receiver's check pace and a loaded machine
    assert time.monotonic() - killed_at < 2 * LEASE_S
    assert [generate(server.routed, f"after{i}", [5, 6]).finish_reason for i in range(3)] == ["length"] * 3
    client = redis.Redis.from_url(redis_url)
    wait_for(
        lambda: not client.hexists(registrations_key("step"), "r1"), 10, 0.05, what="registration removed"
    )
    events = [fields for _, fields in client.xrange(events_key("step"))]
    assert {b"event": b"leave", b"worker": b"r1", b"reason": b"lease expired"} in events


def test_a_restarted_worker_rejoins(server, remote_workers) -> None:
    first = remote_workers("r1")
    wait_for(lambda: served_by(server, "r1"), 20, 0.05, what="r1 in the router")
    os.kill(first.pid, signal.SIGKILL)
    wait_for(lambda: not served_by(server, "r1"), 10, 0.05, what="r1 dropped")
    remote_workers("r1")  # same id: waits out the dead one's lease, then registers
    wait_for(lambda: served_by(server, "r1"), 20, 0.05, what="r1 back in the router")
    assert server.routed.has_live_worker(WorkerId("r1"))


def test_sigterm_says_bye_and_deregisters(server, remote_workers, redis_url, caplog) -> None:
    caplog.set_level(logging.INFO, logger="server.workers.remote")
    process = remote_workers("r1")
    wait_for(lambda: served_by(server, "r1"), 20, 0.05, what="r1 in the router")
    process.terminate()
    wait_for(lambda: not served_by(server, "r1"), 5, 0.02, what="r1 dropped")
    assert "worker r1 is leaving: worker shutting down" in caplog.text  # its "bye", not a heartbeat timeout
    process.join(10)
    assert process.exitcode == 0
    client = redis.Redis.from_url(redis_url)
    assert not client.hexists(registrations_key("step"), "r1")
    assert client.xrevrange(events_key("step"), count=1)[0][1][b"event"] == b"leave"


def stream_on(server: Server, worker_id: str, count: int, max_tokens: int) -> dict[str, queue.SimpleQueue]:
    """Submit requests (round robin over the spawned worker and the remote ones) until `count` run on
    `worker_id`; their outputs' queues by request id."""
    streams: dict[str, queue.SimpleQueue] = {}
    for i in range(4 * count):
        request_id = f"long{i}"
        outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
        sampling = SamplingParams(max_tokens=max_tokens)
        server.routed.submit(GenerationRequest(RequestId(request_id), [1, 2, 3], sampling), outputs.put)
        if server.routed.flights.get(RequestId(request_id)).worker_id == worker_id:
            streams[request_id] = outputs
            if len(streams) == count:
                return streams
    raise AssertionError(f"round robin never reached {worker_id}")


def drain(outputs: queue.SimpleQueue) -> tuple[int, str]:
    """Tokens and finish reason of one request's stream."""
    tokens = 0
    while not (output := outputs.get(timeout=20)).finished:
        tokens += len(output.new_token_ids)
    return tokens + len(output.new_token_ids), output.finish_reason


@pytest.mark.parametrize(
    "exit_timeout_s, step_s, migrated",
    [(30.0, 0.005, False), (0.2, 0.03, True)],  # 150 tokens: 0.75 s and 4.5 s a stream
    ids=["finished-there", "timeout-migrates"],
)
def test_sigterm_drains_then_leaves(server, remote_workers, caplog, exit_timeout_s, step_s, migrated) -> None:
    """SIGTERM (a scale-down): the worker says Draining, the router sends it nothing new, its requests finish
    there within --exit-timeout-secs; past it, what is left resumes elsewhere. No request is lost either way.
    The migrating case's streams outlast any delay in handling the signal on a loaded machine."""
    caplog.set_level(logging.INFO, logger="server")
    process = remote_workers("r1", exit_timeout_s, step_s)
    wait_for(lambda: served_by(server, "r1"), 60, 0.05, what="r1 in the router")
    streams = stream_on(server, "r1", count=2, max_tokens=150)
    process.terminate()
    wait_for(lambda: "worker r1 is draining" in caplog.text, 30, 0.02, what="r1 draining")
    assert not served_by(server, "r1")  # out of the router while its requests run on
    assert [generate(server.routed, f"new{i}", [7]).finish_reason for i in range(4)] == ["length"] * 4
    assert [drain(outputs) for outputs in streams.values()] == [(150, "length")] * 2
    assert ("migrated from r1" in caplog.text) is migrated
    process.join(60)
    assert process.exitcode == 0


def test_one_server_at_a_time_and_the_next_takes_over(redis_url, remote_workers, caplog) -> None:
    caplog.set_level(logging.INFO, logger="server.workers.discovery")
    first, second = start_server(redis_url), start_server(redis_url)
    try:
        remote_workers("r1")
        wait_for(lambda: served_by(first, "r1") or served_by(second, "r1"), 20, 0.05, what="r1 claimed")
        holder, other = (first, second) if served_by(first, "r1") else (second, first)
        # both saw r1 join: the other one tried to claim it and was refused
        wait_for(
            lambda: "worker r1 is held by another server" in caplog.text, 20, 0.05, what="the refused claim"
        )
        claim = redis.Redis.from_url(redis_url)
        claimed_until = time.monotonic() + claim.pttl(claim_key("step", "r1")) / 1000
        # the claim outlives its first lease only if the holder renews it: time itself is the behaviour here
        time.sleep(max(0.0, claimed_until - time.monotonic()) + LEASE_S / 2)
        assert claim.get(claim_key("step", "r1")) == holder.discovery.directory.server_id.encode()
        assert not served_by(other, "r1")
        stop_server(holder)  # lets go of r1, which announces itself free again
        wait_for(lambda: served_by(other, "r1"), 10, 0.05, what="r1 taken over")
        assert generate(other.routed, "x", [1]).finish_reason == "length"
    finally:
        for server in (first, second):
            if server.discovery._thread.is_alive():
                stop_server(server)


def test_worker_whose_server_goes_silent_becomes_free_again(redis_url, remote_workers) -> None:
    remote_workers("r1")
    directory = Directory(redis_url, "step", lease_s=LEASE_S)
    wait_for(lambda: directory.record("r1") is not None, 20, 0.05, what="r1 registered")
    assert directory.claim("r1")
    channel = Channel(directory.record("r1").address, server_side=True, curve=CURVE)  # never acks a beat
    try:
        after = directory.stream_tail()
        channel.send(Attach(directory.server_id))
        assert isinstance(channel.recv(timeout_s=10), Hello)
        events = directory.wait_for_events(after, block_ms=int(LEASE_S * 1000 + 2000))
        assert events and events[0][1] == {"event": "join", "worker": "r1", "reason": "free again"}
        assert directory.claim("r1")  # the worker released this server's claim when it detached
    finally:
        channel.close()
        directory.close()


def test_an_unreadable_registration_is_skipped(redis_url) -> None:
    client = redis.Redis.from_url(redis_url)
    client.hset(registrations_key("step"), "junk", b'{"address": {}}')
    client.set(registration_lease_key("step", "junk"), b"1", px=10_000)
    directory = Directory(redis_url, "step")
    try:
        assert directory.live_records() == [] and directory.record("junk") is None
    finally:
        directory.close()


def test_an_expired_registration_goes_with_its_leave_event_and_a_renewed_one_stays(redis_url) -> None:
    client = redis.Redis.from_url(redis_url)
    for worker_id in ("dead", "renewed"):
        client.hset(registrations_key("step"), worker_id, b"{}")
    client.set(
        registration_lease_key("step", "renewed"), b"1", px=10_000
    )  # renewed after the server saw it lapse
    directory = Directory(redis_url, "step")
    try:
        directory._remove_expired("renewed")
        directory._remove_expired("dead")
        directory._remove_expired("dead")  # a second server that looked at the same time: no second event
    finally:
        directory.close()
    assert client.hkeys(registrations_key("step")) == [b"renewed"]
    events = [fields for _, fields in client.xrange(events_key("step"))]
    assert events == [{b"event": b"leave", b"worker": b"dead", b"reason": b"lease expired"}]
