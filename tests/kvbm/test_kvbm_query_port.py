"""The KVBM service's query link (kvbm/query_port.py, kvbm/client.py, kvbm/wire.py) on an index in this process:
ZMQ CURVE on the cluster's keys. Only a client with the cluster secret gets an answer, nothing crosses the wire
in the clear, and a client's query costs at most one timeout."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from kvbm_testing import CLUSTER_SECRET, ZMTP_SIGNATURE, old_style_query, read_until_closed

from cluster.curve import CurveKeys, make_server
from harness.waiting import wait_for
from kvbm.block_hash import BlockHash
from kvbm.client import KVIndexClient
from kvbm.events import G1, G2, TierEvent
from kvbm.index import KVIndex, PrefixReport, WorkerPrefix
from kvbm.metrics import KVBMMetrics
from kvbm.query_port import QueryPort
from kvbm.wire import PrefixAnswer, PrefixQuery, service_keys

KEYS = service_keys(CLUSTER_SECRET)
BLOCKS = [BlockHash(h) for h in range(1, 9)]
TIMEOUT_S = 1.0  # the client's; twice it is the bound on a query that gets no answer


@pytest.fixture
def index() -> KVIndex:
    index = KVIndex()
    index.apply(TierEvent("worker-a", "stored", G1, tuple(BLOCKS[:4])))
    index.apply(TierEvent("worker-a", "stored", G2, tuple(BLOCKS)))
    return index


@pytest.fixture
def port(index: KVIndex) -> Iterator[QueryPort]:
    running = QueryPort(index, KEYS, KVBMMetrics(), "127.0.0.1", 0)
    running.start()
    yield running
    running.stop()


def endpoint(port: QueryPort) -> str:
    return f"{port.address[0]}:{port.address[1]}"


def refusals(port: QueryPort) -> float:
    return port.metrics.registry.get_sample_value("kvbm_service_auth_failures_total")


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    received = b""
    while len(received) < size and (chunk := sock.recv(size - len(received))):
        received += chunk
    return received


def no_answer(client: KVIndexClient) -> None:
    """The query fails within one timeout, never hangs. The time is the contract (a query costs at most one
    timeout): the bound is twice the client's timeout."""
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="another cluster secret"):
        client.query(BLOCKS)
    assert time.monotonic() - started < 2 * client.timeout_s


def test_an_answer_round_trips_through_the_wire() -> None:
    answer = PrefixAnswer(7, PrefixReport(4, {"w": WorkerPrefix(1, 2, 3)}, 4), 9)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(answer), type=PrefixAnswer) == answer


def test_a_client_with_another_secret_gets_no_answer_and_is_counted(port: QueryPort) -> None:
    intruder = KVIndexClient(
        endpoint(port), service_keys(b"another-cluster-secret-0123"), timeout_s=TIMEOUT_S
    )
    try:
        no_answer(intruder)
    finally:
        intruder.close()
    wait_for(lambda: refusals(port) >= 1, 5, 0.02, what="the refused handshake counted")


def test_zap_refuses_a_client_that_knows_the_service_key_but_not_the_cluster_secret(
    port: QueryPort, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="cluster.curve")
    public, secret = zmq.curve_keypair()
    stolen = CurveKeys(
        KEYS.server_public, b"", public, secret
    )  # the service's public key, a key pair of its own
    intruder = KVIndexClient(endpoint(port), stolen, timeout_s=TIMEOUT_S)
    try:
        no_answer(intruder)
    finally:
        intruder.close()
    wait_for(lambda: refusals(port) >= 1, 5, 0.02, what="the ZAP refusal counted")
    assert "not the cluster's" in caplog.text


def test_a_raw_tcp_client_of_the_old_protocol_is_closed_unanswered(port: QueryPort) -> None:
    with socket.create_connection(port.address) as raw:
        raw.sendall(old_style_query(BLOCKS))
        received = read_until_closed(raw, 5)
    assert received in (b"", ZMTP_SIGNATURE)  # at most the start of ZMQ's greeting, never an answer


def test_the_port_greets_with_curve_and_drops_a_plaintext_peer(port: QueryPort) -> None:
    """What a raw socket sees of the port: ZMTP 3's greeting naming the CURVE mechanism; offered NULL (no
    encryption), the port closes the connection without another byte."""
    with socket.create_connection(port.address) as raw:
        raw.settimeout(5)
        assert recv_exactly(raw, 10) == ZMTP_SIGNATURE
        raw.sendall(ZMTP_SIGNATURE + b"\x03")  # ZMTP major version 3: the port sends the rest of its greeting
        greeting = recv_exactly(raw, 54)
        raw.sendall(b"\x00" + b"NULL".ljust(20, b"\x00") + bytes(32))  # minor, mechanism, as-server, filler
        after = read_until_closed(raw, 5)
    assert greeting[0] == 3 and greeting[2:22].rstrip(b"\x00") == b"CURVE"
    assert after == b""


def test_a_frame_that_is_not_a_query_is_dropped_and_the_port_keeps_answering(
    port: QueryPort, index: KVIndex, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvbm.query_port")
    client = KVIndexClient(endpoint(port), KEYS)
    try:
        client._socket.send(msgspec.msgpack.encode({"seq": 1, "block_hashes": [-1]}))
        wait_for(lambda: "not a query" in caplog.text, 5, 0.02, what="the bad frame logged")
        assert "$.block_hashes[0]" in caplog.text
        assert client.query(BLOCKS) == index.query(BLOCKS)
    finally:
        client.close()


def test_a_dead_service_costs_one_timeout_and_a_restarted_one_answers(index: KVIndex) -> None:
    first = QueryPort(index, KEYS, KVBMMetrics(), "127.0.0.1", 0)
    first.start()
    client = KVIndexClient(endpoint(first), KEYS, timeout_s=TIMEOUT_S)
    second = None
    try:
        assert client.query(BLOCKS) == index.query(BLOCKS)
        first.stop()
        no_answer(client)
        second = QueryPort(index, KEYS, KVBMMetrics(), "127.0.0.1", first.address[1])
        second.start()
        wait_for(lambda: answers(client, index), 5, 0.02, what="the restarted service to answer")
    finally:
        client.close()
        if second is not None:
            second.stop()


def answers(client: KVIndexClient, index: KVIndex) -> bool:
    try:
        return client.query(BLOCKS) == index.query(BLOCKS)
    except TimeoutError:
        return False


def test_a_late_answer_is_not_taken_for_the_next_query() -> None:
    """A fake service answers the first query only after the client gave up on it: the client drops that
    answer by its seq and returns the second query's own."""
    stale, fresh = (
        PrefixReport(8, {"stale": WorkerPrefix(1, 1, 1)}),
        PrefixReport(8, {"fresh": WorkerPrefix(2, 2, 2)}),
    )
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.linger = 0
    make_server(router, KEYS, b"fake")  # no ZAP handler on this context: any client key is admitted
    bound = router.bind_to_random_port("tcp://127.0.0.1")
    released = threading.Event()
    fake = threading.Thread(target=answer_late, args=(router, released, [stale, fresh]), daemon=True)
    fake.start()
    client = KVIndexClient(f"127.0.0.1:{bound}", KEYS, timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(TimeoutError):
            client.query(BLOCKS)
        released.set()
        assert client.query(BLOCKS) == fresh
    finally:
        client.close()
        fake.join(5)
        router.close()  # here, not in the fake's thread: a closed socket drops what it has not sent yet
        context.term()


def answer_late(router: zmq.Socket, released: threading.Event, reports: list[PrefixReport]) -> None:
    """Answer the first query once `released` is set, then the second at once (each with the next report)."""
    decoder = msgspec.msgpack.Decoder(PrefixQuery)
    for turn, report in enumerate(reports):
        if not router.poll(5000):
            return
        peer, frame = router.recv_multipart()
        if turn == 0:
            released.wait(5)
        answer = PrefixAnswer(decoder.decode(frame).seq, report, turn)
        router.send_multipart([peer, msgspec.msgpack.encode(answer)])
