"""kvbm.transfer and kvbm.transfer_tcp: prefill -> decode KV handoffs through shm (same host) and tcp (across
hosts, CURVE-authenticated): round trips, partial reads, validation, authentication, expiry, and which
transport KVTransfer picks."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import zmq

import kvbm.transfer_tcp as transfer_tcp
from cluster.curve import make_client as real_make_client
from harness.waiting import wait_for
from kvbm.transfer import KVTransfer, ShmTransport, TransferError
from kvbm.transfer_tcp import TcpTransport, _header, transfer_keys

SECRET = b"0123456789abcdef0123456789abcdef"
OTHER_SECRET = b"fedcba9876543210fedcba9876543210"
BLOCKS, BLOCK_BYTES = 40, 4096
HASHES = [(i * 0x9E37_79B9_7F4A_7C15) & 0xFFFF_FFFF_FFFF_FFFF for i in range(1, BLOCKS + 1)]
FAST_S = 0.3  # fetch timeout of tests that expect no answer


@pytest.fixture
def pool() -> np.ndarray:
    """A source pool of BLOCKS random rows of BLOCK_BYTES."""
    return np.random.default_rng(7).integers(0, 256, (BLOCKS, BLOCK_BYTES), dtype=np.uint8)


@pytest.fixture
def tcp() -> Iterator[TcpTransport]:
    transport = TcpTransport(SECRET, bind_host="127.0.0.1", fetch_timeout_s=5.0)
    yield transport
    transport.close()


@pytest.fixture(params=["shm", "tcp"])
def transport(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ShmTransport | TcpTransport]:
    if request.param == "shm":
        chosen = ShmTransport(directory=tmp_path)
    else:
        chosen = TcpTransport(SECRET, bind_host="127.0.0.1", fetch_timeout_s=5.0)
    yield chosen
    chosen.close()


def empty_rows(count: int) -> np.ndarray:
    return np.zeros((count, BLOCK_BYTES), dtype=np.uint8)


def test_round_trip_fills_the_rows_with_the_source_blocks(transport, pool):
    order = np.random.default_rng(1).permutation(BLOCKS)  # a block table's rows, not in pool order
    location = transport.send(HASHES, [pool[i] for i in order])
    source = transport.fetch(location, HASHES, BLOCK_BYTES)
    dest = empty_rows(BLOCKS)
    assert source.read_into(0, list(dest)) == BLOCKS
    source.release()
    source.release()  # idempotent
    assert np.array_equal(dest, pool[order])


def test_read_into_from_a_later_block_fills_what_is_left(transport, pool):
    source = transport.fetch(transport.send(HASHES, list(pool)), HASHES, BLOCK_BYTES)
    few = empty_rows(5)
    assert source.read_into(10, list(few)) == 5
    assert np.array_equal(few, pool[10:15])
    tail = empty_rows(8)  # more rows than blocks left after block 35
    assert source.read_into(35, list(tail)) == 5
    assert np.array_equal(tail[:5], pool[35:]) and not tail[5:].any()
    assert source.read_into(BLOCKS, list(tail)) == 0
    source.release()
    assert source.read_into(0, list(tail)) == 0  # released: nothing more to read


def test_the_sent_copy_does_not_change_with_the_source_rows(transport, pool):
    original = pool.copy()
    location = transport.send(HASHES, list(pool))
    pool[:] = 0  # the engine reuses the rows as soon as send returns
    source = transport.fetch(location, HASHES, BLOCK_BYTES)
    dest = empty_rows(BLOCKS)
    assert source.read_into(0, list(dest)) == BLOCKS
    source.release()
    assert np.array_equal(dest, original)


def test_other_block_hashes_are_refused(transport, pool):
    location = transport.send(HASHES, list(pool))
    with pytest.raises(TransferError, match="other blocks"):
        transport.fetch(location, [h ^ 1 for h in HASHES], BLOCK_BYTES)


@pytest.mark.parametrize("block_bytes", [2 * BLOCK_BYTES, BLOCK_BYTES // 2])
def test_another_block_size_is_refused(transport, pool, block_bytes):
    location = transport.send(HASHES, list(pool))
    with pytest.raises(TransferError, match="another layout"):
        transport.fetch(location, HASHES, block_bytes)


def test_another_block_count_is_refused(transport, pool):
    location = transport.send(HASHES, list(pool))
    with pytest.raises(TransferError, match="another layout"):
        transport.fetch(location, HASHES[:-1], BLOCK_BYTES)


@pytest.mark.parametrize(
    "location",
    ["", "../x", "../../etc/passwd", "strata-kvx-1-0123456789abcdef-0/../x", "/dev/shm/strata-kvx-1-0-0"],
)
def test_shm_refuses_malformed_names(tmp_path, location):
    shm = ShmTransport(directory=tmp_path)
    with pytest.raises(TransferError, match="not a shm handoff name"):
        shm.fetch(location, HASHES, BLOCK_BYTES)


KEY = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    "location",
    [
        "",
        f"http://127.0.0.1:5555/{KEY}",
        f"tcp://127.0.0.1/{KEY}",  # no port
        f"tcp://:5555/{KEY}",  # no host
        f"tcp://127.0.0.1:0/{KEY}",
        f"tcp://127.0.0.1:65536/{KEY}",
        f"tcp://127.0.0.1:99999/{KEY}",
        f"tcp://host;rm -rf:5555/{KEY}",
        f"tcp://-host:5555/{KEY}",
        "tcp://127.0.0.1:5555/../x",
        "tcp://127.0.0.1:5555/" + KEY[:-1],  # short key
        "tcp://127.0.0.1:5555/" + KEY.upper(),
        "tcp://127.0.0.1:5555/" + KEY + "0",
        f"tcp://127.0.0.1:5555/{KEY}/../x",
        f"tcp://127.0.0.1:5555/{KEY}\n",
    ],
)
def test_tcp_refuses_malformed_locations(tcp, location):
    with pytest.raises(TransferError, match="not a tcp handoff location"):
        tcp.fetch(location, HASHES, BLOCK_BYTES)


def test_tcp_unknown_key_fails_at_once(tcp, pool):
    location = tcp.send(HASHES, list(pool))
    unknown = location.rsplit("/", 1)[0] + "/" + KEY
    # the sender's answer, at once: a fetch that waited out its timeout fails with "no answer within"
    with pytest.raises(TransferError, match="unknown to its sender"):
        tcp.fetch(unknown, HASHES, BLOCK_BYTES)
    assert tcp.pending == 1


def test_tcp_handoff_is_served_once(tcp, pool):
    location = tcp.send(HASHES, list(pool))
    tcp.fetch(location, HASHES, BLOCK_BYTES).release()
    assert tcp.pending == 0
    with pytest.raises(TransferError, match="unknown to its sender"):
        tcp.fetch(location, HASHES, BLOCK_BYTES)


def test_tcp_nobody_listening_fails_within_the_timeout(pool):
    timeout_s = 1.0
    sender = TcpTransport(SECRET, bind_host="127.0.0.1")
    location = sender.send(HASHES, list(pool))
    sender.close()
    fetcher = TcpTransport(SECRET, bind_host="127.0.0.1", fetch_timeout_s=timeout_s)
    try:
        started = time.monotonic()
        with pytest.raises(TransferError, match=f"no answer within {timeout_s:g} s"):
            fetcher.fetch(location, HASHES, BLOCK_BYTES)
        # the time is the contract: one timeout, never a hang; twice the timeout bounds it
        assert time.monotonic() - started < 2 * timeout_s
    finally:
        fetcher.close()


def test_tcp_a_fetcher_with_another_secret_gets_nothing(tcp, pool):
    location = tcp.send(HASHES, list(pool))
    stranger = TcpTransport(OTHER_SECRET, bind_host="127.0.0.1", fetch_timeout_s=FAST_S)
    try:
        with pytest.raises(TransferError, match="no answer within"):
            stranger.fetch(location, HASHES, BLOCK_BYTES)
    finally:
        stranger.close()
    assert tcp.pending == 1  # not delivered: still there for a fetcher with the cluster's secret
    source = tcp.fetch(location, HASHES, BLOCK_BYTES)
    dest = empty_rows(BLOCKS)
    assert source.read_into(0, list(dest)) == BLOCKS
    assert np.array_equal(dest, pool)


def test_tcp_a_peer_that_knows_the_public_key_but_not_the_secret_is_refused(tcp, pool, caplog):
    """The CURVE handshake alone admits any client key; the ZAP handler admits only the cluster's."""
    caplog.set_level(logging.WARNING, logger="cluster.curve")
    location = tcp.send(HASHES, list(pool))
    own_public, own_secret = zmq.curve_keypair()
    context = zmq.Context()
    peer = context.socket(zmq.DEALER)
    try:
        peer.linger = 0
        peer.curve_serverkey = transfer_keys(SECRET).server_public
        peer.curve_publickey, peer.curve_secretkey = own_public, own_secret
        peer.connect(f"tcp://127.0.0.1:{tcp.port}")
        peer.send(location.rsplit("/", 1)[1].encode())
        wait_for(lambda: "not the cluster's" in caplog.text, 5.0, interval=0.01, what="the ZAP refusal")
        assert not peer.poll(0)  # refused before its request reached the sender: no answer can come
    finally:
        peer.close()
        context.term()
    assert tcp.pending == 1


def test_tcp_a_frame_over_the_expected_size_is_not_read():
    """A fetcher bounds its MAXMSGSIZE to the block size it expects: ZMQ drops a bigger block frame unread."""
    big_blocks = np.ones((4, 16 * BLOCK_BYTES), dtype=np.uint8)
    tcp = TcpTransport(SECRET, bind_host="127.0.0.1", fetch_timeout_s=FAST_S)
    try:
        location = tcp.send(HASHES[:4], list(big_blocks))
        with pytest.raises(TransferError, match="no answer within"):
            tcp.fetch(location, HASHES[:4], BLOCK_BYTES)
    finally:
        tcp.close()


def test_tcp_concurrent_fetches_each_get_their_own_blocks(tcp, pool):
    locations = [tcp.send(HASHES, list(np.roll(pool, i, axis=0))) for i in range(4)]

    def fetch(i: int) -> np.ndarray:
        source = tcp.fetch(locations[i], HASHES, BLOCK_BYTES)
        dest = empty_rows(BLOCKS)
        source.read_into(0, list(dest))
        source.release()
        return dest

    with ThreadPoolExecutor(4) as threads:
        received = list(threads.map(fetch, range(4)))
    for i, dest in enumerate(received):
        assert np.array_equal(dest, np.roll(pool, i, axis=0))


def test_tcp_close_ends_a_fetch_in_flight(pool, monkeypatch):
    """close() while a fetch that will never be answered has its socket open: the fetch fails because the
    context was terminated, not after its own timeout ("no answer within")."""
    sender = TcpTransport(OTHER_SECRET, bind_host="127.0.0.1")
    fetcher = TcpTransport(SECRET, bind_host="127.0.0.1", fetch_timeout_s=30.0)  # never answered
    in_flight = threading.Event()

    def make_client(socket: zmq.Socket, keys) -> None:
        real_make_client(socket, keys)
        in_flight.set()  # the fetch's socket is open in the fetcher's context

    monkeypatch.setattr(transfer_tcp, "make_client", make_client)
    try:
        location = sender.send(HASHES, list(pool))
        with ThreadPoolExecutor(1) as threads:
            fetching = threads.submit(fetcher.fetch, location, HASHES, BLOCK_BYTES)
            assert in_flight.wait(10)
            fetcher.close()
            with pytest.raises(TransferError, match="Context was terminated"):
                fetching.result(timeout=2 * fetcher.fetch_timeout_s)  # a hang guard only
    finally:
        fetcher.close()
        sender.close()


def answer_once(reply: list[bytes]) -> tuple[str, Future]:
    """A CURVE server with the cluster's sender keys that answers one request with `reply` (a sender speaking
    another protocol, or a broken one); (its location, the future of its thread)."""
    keys = transfer_keys(SECRET)
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.linger = 5000  # closing right after the send: let the answer go out first
    server.curve_server = True
    server.curve_publickey, server.curve_secretkey = keys.server_public, keys.server_secret
    port = server.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        try:
            if server.poll(5000):
                peer, _ = server.recv_multipart()
                server.send_multipart([peer, *reply])
        finally:
            server.close()
            context.term()

    thread = ThreadPoolExecutor(1)
    served = thread.submit(serve)
    thread.shutdown(wait=False)  # it ends after its one answer (or 5 s without a request)
    return f"tcp://127.0.0.1:{port}/{KEY}", served


@pytest.mark.parametrize(
    "reply, error",
    [
        ([b"not a header"], "another layout or not a handoff"),
        ([b"PICKLE!!" + bytes(16 + 8 * BLOCKS)], "another layout or not a handoff"),
        ([_header(HASHES, BLOCK_BYTES)], "0 blocks"),  # header only
        ([_header(HASHES, BLOCK_BYTES), *[bytes(BLOCK_BYTES)] * (BLOCKS - 1)], "39 blocks"),
        ([_header(HASHES, BLOCK_BYTES), *[bytes(BLOCK_BYTES - 1)] * BLOCKS], "other sizes"),
    ],
)
def test_tcp_a_malformed_answer_is_refused(tcp, reply, error):
    location, served = answer_once(reply)
    with pytest.raises(TransferError, match=error):
        tcp.fetch(location, HASHES, BLOCK_BYTES)
    served.result(timeout=5)


def test_tcp_over_ipv6(pool):
    try:
        tcp = TcpTransport(SECRET, bind_host="::1", fetch_timeout_s=5.0)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        location = tcp.send(HASHES, list(pool))
        assert location.startswith(f"tcp://[::1]:{tcp.port}/")
        dest = empty_rows(BLOCKS)
        assert tcp.fetch(location, HASHES, BLOCK_BYTES).read_into(0, list(dest)) == BLOCKS
        assert np.array_equal(dest, pool)
    finally:
        tcp.close()


def test_tcp_a_port_in_use_is_a_clear_error(tcp):
    with pytest.raises(OSError, match=f"cannot bind tcp://127.0.0.1:{tcp.port}"):
        TcpTransport(SECRET, bind_host="127.0.0.1", port=tcp.port)


def test_tcp_needs_a_cluster_secret():
    for secret in (b"", None, b"short"):
        with pytest.raises(ValueError, match="cluster secret"):
            TcpTransport(secret, bind_host="127.0.0.1")


def test_shm_ttl_removes_handoffs_never_fetched(tmp_path, pool):
    shm = ShmTransport(directory=tmp_path, ttl_s=0.05)
    stale = shm.send(HASHES, list(pool))
    time.sleep(0.1)  # let its ttl pass (the ttl is the behaviour under test)
    fresh = shm.send(HASHES, list(pool))  # each send sweeps
    assert not (tmp_path / stale).exists() and (tmp_path / fresh).exists()
    with pytest.raises(TransferError, match="No such file"):
        shm.fetch(stale, HASHES, BLOCK_BYTES)
    shm.close()


def test_tcp_ttl_removes_handoffs_never_fetched(pool):
    tcp = TcpTransport(SECRET, bind_host="127.0.0.1", ttl_s=0.5, fetch_timeout_s=5.0)
    try:
        stale = tcp.send(HASHES, list(pool))
        time.sleep(0.6)  # let its ttl pass (the ttl is the behaviour under test)
        fresh = tcp.send(HASHES, list(pool))  # sweeps (if the server thread has not yet)
        assert tcp.pending == 1
        with pytest.raises(TransferError, match="unknown to its sender"):
            tcp.fetch(stale, HASHES, BLOCK_BYTES)
        tcp.fetch(fresh, HASHES, BLOCK_BYTES).release()
    finally:
        tcp.close()


def test_tcp_server_thread_sweeps_without_further_sends(pool):
    tcp = TcpTransport(SECRET, bind_host="127.0.0.1", ttl_s=0.05)
    try:
        tcp.send(HASHES, list(pool))
        wait_for(lambda: tcp.pending == 0, timeout=5.0, interval=0.01, what="the server thread's sweep")
    finally:
        tcp.close()


def test_close_is_idempotent_and_drops_every_handoff(tmp_path, pool):
    shm = ShmTransport(directory=tmp_path)
    for _ in range(3):
        shm.send(HASHES, list(pool))
    shm.close()
    shm.close()
    assert not list(tmp_path.iterdir())

    tcp = TcpTransport(SECRET, bind_host="127.0.0.1", fetch_timeout_s=FAST_S)
    location = tcp.send(HASHES, list(pool))
    tcp.close()
    tcp.close()
    assert tcp.pending == 0
    with pytest.raises(TransferError):
        tcp.fetch(location, HASHES, BLOCK_BYTES)
    with pytest.raises(TransferError, match="closed"):
        tcp.send(HASHES, list(pool))


def test_kv_transfer_picks_shm_on_this_host_and_tcp_for_another(tmp_path, tcp, pool):
    transfer = KVTransfer([ShmTransport(directory=tmp_path), tcp], host="prefill-host")
    shm_kind, shm_location = transfer.send("prefill-host", HASHES, list(pool))
    tcp_kind, tcp_location = transfer.send("decode-host", HASHES, list(pool))
    assert shm_kind == "shm" and (tmp_path / shm_location).exists()
    assert tcp_kind == "tcp" and tcp_location.startswith(f"tcp://127.0.0.1:{tcp.port}/")
    for kind, location in ((shm_kind, shm_location), (tcp_kind, tcp_location)):
        source = transfer.fetch(kind, location, HASHES, BLOCK_BYTES)
        dest = empty_rows(BLOCKS)
        assert source.read_into(0, list(dest)) == BLOCKS
        source.release()
        assert np.array_equal(dest, pool)
    with pytest.raises(TransferError, match="no 'nixl' transport"):
        transfer.fetch("nixl", "anywhere", HASHES, BLOCK_BYTES)
    transfer.close()


def test_kv_transfer_without_a_network_transport_sends_nothing_to_another_host(tmp_path, pool):
    transfer = KVTransfer([ShmTransport(directory=tmp_path)], host="prefill-host")
    assert transfer.send("decode-host", HASHES, list(pool)) == ("none", "")
    assert transfer.send("prefill-host", HASHES, []) == ("none", "")
    assert not list(tmp_path.iterdir())
    transfer.close()
