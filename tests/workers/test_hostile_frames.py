"""Frames that are not messages, sent with a raw ZMQ socket to a remote worker's TCP port and to a server's link:
today's pickle exploit runs nothing; every such frame is dropped, counted, and costs its link; both ends keep
serving."""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from cluster.curve import CurveKeys
from harness.waiting import wait_for
from kvbm.index import KVIndex
from server.engine.api import GenerationOutput, GenerationRequest, RequestId, SamplingParams
from server.router.config import RouterConfig
from server.router.metrics import RouterMetrics
from server.router.routed import RoutedEngine
from server.router.router import Router
from server.workers.protocol import MAX_MESSAGE_BYTES, Codec, Hello, ToServer, WorkerId
from server.workers.registry import Directory
from server.workers.remote import RemoteEngine, WorkerDied, spawn_workers
from server.workers.remote_worker import RemoteWorker, RemoteWorkerOptions
from server.workers.transport import link_keys
from server.workers.worker import WorkerSpec, describe
from tests.workers.worker_fakes import CURVE, FAKE_SPEEDS, SALT, StepEngine

LEASE_S = 1.5


class _Exploit:
    """Unpickling this runs `touch path`: what the pickled protocol let anyone who reached a port do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def pickle_exploit(path: Path) -> bytes:
    """Today's `submit` call carrying the exploit, as `send_pyobj` framed it."""
    return pickle.dumps(("call", 0, "submit", (_Exploit(path),)))


def test_the_exploit_is_live(tmp_path: Path) -> None:
    """The payload does run when unpickled, so the tests below would catch a receiver that unpickles."""
    pickle.loads(pickle_exploit(tmp_path / "ran"))
    assert (tmp_path / "ran").exists()


def push(endpoint: str, frame: bytes, curve: CurveKeys | None = None) -> None:
    """Send one raw frame from a fresh PUSH socket. To a worker's TCP port only a peer holding the cluster
    secret gets through (`curve`: a compromised server's keys, so the frame reaches the decoder); to a server's
    ipc link, a process of the same user."""
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            curve.server_public,
            curve.client_public,
            curve.client_secret,
        )
    sock.connect(endpoint)
    sock.send(frame)
    sock.close()
    context.term()


BAD_FRAMES = {
    "not msgpack": b"\xc1\xc1",
    "unknown kind": msgspec.msgpack.encode(["Zap", 1]),
    "the other direction's kind": Codec(ToServer).encode(Hello(describe(StepEngine(), FAKE_SPEEDS))),
    "truncated": msgspec.msgpack.encode(["Attach", "server-x" * 8])[:-5],
    "oversized": msgspec.msgpack.encode(["Attach", "x" * MAX_MESSAGE_BYTES]),
}


def generate(engine: RemoteEngine | RoutedEngine, request_id: str, max_tokens: int = 3) -> GenerationOutput:
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    engine.submit(
        GenerationRequest(RequestId(request_id), [1, 2, 3], SamplingParams(max_tokens=max_tokens)),
        outputs.put,
    )
    while not (output := outputs.get(timeout=10)).finished:
        pass
    return output


@pytest.fixture
def remote_worker(redis_url: str) -> Iterator[RemoteWorker]:
    """A `strata worker` (StepEngine inside) in a thread of this process, so its counter can be read."""
    engine = StepEngine(0.002, worker_id="r1")
    options = RemoteWorkerOptions(
        "r1",
        redis_url,
        host="127.0.0.1",
        advertise_host="127.0.0.1",
        lease_s=LEASE_S,
        heartbeat_s=0.2,
        curve=CURVE,
    )
    worker = RemoteWorker(engine, describe(engine, FAKE_SPEEDS), options)
    thread = threading.Thread(target=worker.run, name="remote-worker", daemon=True)
    thread.start()
    directory = Directory(redis_url, "step", lease_s=LEASE_S)
    try:
        wait_for(lambda: directory.record("r1") is not None, 10, 0.02, what="r1 registered")
    finally:
        directory.close()
    yield worker
    worker.stop.set()
    thread.join(10)
    engine.close()


@contextlib.contextmanager
def attached(redis_url: str) -> Iterator[RemoteEngine]:
    """A server's link to r1: claim it, connect; always closed and released."""
    directory = Directory(redis_url, "step", lease_s=LEASE_S)
    try:
        record = directory.record("r1")
        assert record is not None and directory.claim("r1")
        remote = RemoteEngine.connect(
            WorkerId("r1"), record.address, directory.server_id, CURVE, heartbeat_timeout_s=LEASE_S
        )
        try:
            yield remote
        finally:
            remote.close()
            directory.release("r1")
    finally:
        directory.close()


def test_the_pickle_exploit_on_a_free_worker_runs_nothing_and_it_serves_on(
    remote_worker, redis_url, tmp_path
) -> None:
    target = tmp_path / "pwned"
    push(remote_worker.address.to_worker, pickle_exploit(target), CURVE)
    wait_for(lambda: remote_worker.messages_rejected == 1, 10, 0.02, what="the frame rejected")
    assert not target.exists()
    with attached(redis_url) as remote:
        assert generate(remote, "after").finish_reason == "length"


def test_the_pickle_exploit_on_a_serving_worker_drops_its_server_and_it_serves_the_next(
    remote_worker, redis_url, tmp_path
) -> None:
    target = tmp_path / "pwned"
    directory = Directory(redis_url, "step", lease_s=LEASE_S)
    try:
        with attached(redis_url) as first:
            assert generate(first, "before").finish_reason == "length"
            after = directory.stream_tail()
            push(remote_worker.address.to_worker, pickle_exploit(target), CURVE)
            wait_for(lambda: not first.alive, 10, 0.02, what="the worker to drop its server")
        assert remote_worker.messages_rejected == 1 and not target.exists()
        events = directory.wait_for_events(after, block_ms=10_000)
        assert events and events[0][1] == {"event": "join", "worker": "r1", "reason": "free again"}
    finally:
        directory.close()
    with attached(redis_url) as second:
        assert generate(second, "after").finish_reason == "length"


def test_every_kind_of_bad_frame_is_dropped_and_counted_by_a_worker(remote_worker, redis_url) -> None:
    for count, (kind, frame) in enumerate(BAD_FRAMES.items(), start=1):
        push(remote_worker.address.to_worker, frame, CURVE)
        wait_for(
            lambda n=count: remote_worker.messages_rejected == n, 10, 0.02, what=f"the {kind} frame rejected"
        )
    with attached(redis_url) as remote:
        assert generate(remote, "after").finish_reason == "length"


@pytest.mark.parametrize("kind", ["pickle exploit", "oversized"])
def test_a_bad_frame_on_a_server_link_drops_that_worker_and_its_requests_migrate(kind: str, tmp_path) -> None:
    target = tmp_path / "pwned"
    frame = pickle_exploit(target) if kind == "pickle exploit" else BAD_FRAMES[kind]
    registry = CollectorRegistry()
    router = Router(RouterConfig(), KVIndex(), RouterMetrics.create(registry))
    workers = spawn_workers([WorkerId("w0"), WorkerId("w1")], WorkerSpec(StepEngine, (0.01,)))
    routed = RoutedEngine(workers, router, block_size=4, salt=SALT)
    try:
        outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
        routed.submit(
            GenerationRequest(RequestId("long"), [1, 2, 3], SamplingParams(max_tokens=40)), outputs.put
        )
        outputs.get(timeout=10)
        victim = next(w for w in workers if w.worker_id == routed.flights.get(RequestId("long")).worker_id)
        push(victim._channel.address.to_server, frame)  # the server's bound PULL endpoint of that link
        wait_for(lambda: not victim.alive, 10, 0.02, what="the link dropped")
        got = [outputs.get(timeout=10)]
        while not got[-1].finished:
            got.append(outputs.get(timeout=10))
        assert got[-1].finish_reason == "length" and got[-1].num_output_tokens == 40  # migrated, not failed
        assert victim.messages_rejected == 1 and not target.exists()
        metrics = generate_latest(registry).decode()
        assert f'strata_worker_messages_rejected_total{{worker="{victim.worker_id}"}} 1.0' in metrics
        assert [generate(routed, f"after{i}").finish_reason for i in range(3)] == ["length"] * 3
    finally:
        routed.close()


@pytest.mark.parametrize("keys", ["none", "another secret"])
def test_a_peer_without_the_cluster_secret_reaches_nothing(
    remote_worker, redis_url, tmp_path, keys: str
) -> None:
    """CURVE: a peer with no keys, or with the keys of another secret, never completes the handshake, so even a
    well-formed Attach (and the pickle exploit) never reaches the decoder. (`push` returns once its socket gave
    up delivering, after its linger; frames that arrived would be decoded before the real server's Attach.)"""
    target = tmp_path / "pwned"
    curve = None if keys == "none" else link_keys(b"another-cluster-secret-0123456789")
    push(remote_worker.address.to_worker, pickle_exploit(target), curve)
    push(remote_worker.address.to_worker, msgspec.msgpack.encode(["Attach", "intruder"]), curve)
    assert remote_worker.messages_rejected == 0 and not target.exists()
    with attached(redis_url) as remote:  # the real server, holding the secret, is served
        assert generate(remote, "after").finish_reason == "length"


def test_a_server_with_another_secret_gets_no_hello(remote_worker, redis_url) -> None:
    directory = Directory(redis_url, "step", lease_s=LEASE_S)
    try:
        record = directory.record("r1")
        assert record is not None and directory.claim("r1")
        wrong = link_keys(b"another-cluster-secret-0123456789")
        with pytest.raises(WorkerDied, match="another cluster secret"):
            RemoteEngine.connect(
                WorkerId("r1"), record.address, directory.server_id, wrong, start_timeout_s=2
            )
        directory.release("r1")
    finally:
        directory.close()
    with attached(redis_url) as remote:
        assert generate(remote, "after").finish_reason == "length"
