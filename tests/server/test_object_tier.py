"""`strata serve --kvbm-object-url` against a real S3 server (SeaweedFS) behind a fault proxy: a second server
with a fresh G2, no G3 and no Redis answers a long prompt from the blocks the first one wrote (as it computed them,
or on its graceful stop from G2 after its uploads had failed), with the same greedy text; with the endpoint
silent, a prompt the bucket holds is recomputed, with the same text."""

from __future__ import annotations

import itertools
import signal
import time
import uuid

import pytest

from harness.fault_proxy import FaultProxy
from harness.metrics import samples, scrape
from harness.s3_server import BUCKET
from harness.servers import smollm2_repository, triton_generate
from harness.waiting import wait_for
from kvbm.object_pool import CIRCUIT_MAX_S

pytestmark = pytest.mark.slow


def document(topic: str) -> str:
    """About 400 tokens (25 blocks of 16)."""
    sentences = [
        f"Paragraph {i} is about {topic} and how it changed daily life in town {i}." for i in range(22)
    ]
    return " ".join(sentences) + " In one sentence, the main effect was"


def generate(server, prompt: str) -> dict:
    return triton_generate(server, prompt, max_tokens=8)


def series(server, name: str, **labels: str) -> float:
    page = scrape(server.openai_url)
    return sum(value for found, value in samples(page, name) if labels.items() <= found.items())


@pytest.fixture
def proxy(s3_server, monkeypatch) -> FaultProxy:
    """A fault proxy in front of the session's S3 server, the AWS_* environment pointing at it; stopped after."""
    proxy = FaultProxy(s3_server.port)
    proxy.start()
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    yield proxy
    proxy.stop()


def test_second_server_answers_from_the_bucket(strata, tmp_path, proxy) -> None:
    repository = smollm2_repository(tmp_path, max_model_len=1024, max_concurrent_requests=2)
    url = f"s3://{BUCKET}/server-{uuid.uuid4().hex[:8]}"
    timeout_s = 1.0
    tiers = (
        "--kvbm-object-url",
        url,
        "--kvbm-host-cache-gb",
        "0.05",
        "--kvbm-object-timeout-secs",
        str(timeout_s),
    )
    first = strata(repository, *tiers, "--kvbm-write-through", "--kvbm-cache-id", f"a-{uuid.uuid4().hex[:8]}")
    prompt, other = document("the printing press"), document("the steam engine")
    expected = generate(first, prompt)
    started = time.monotonic()
    expected_other = generate(first, other)
    cold_s = time.monotonic() - started  # `other` computed from nothing
    assert first.stop(signal.SIGTERM) == 0  # drains the uploads

    second = strata(repository, *tiers, "--kvbm-cache-id", f"b-{uuid.uuid4().hex[:8]}")
    answer = generate(second, prompt)
    assert answer["text_output"] == expected["text_output"]
    assert answer["num_cached_tokens"] >= 16 * 24, answer["num_cached_tokens"]
    assert series(second, "kvbm_onboard_blocks_total", direction="G5->G1") >= 24

    proxy.mode = "stall"  # the store stops answering mid-run: `other` (in the bucket) is recomputed
    started = time.monotonic()
    stalled = generate(second, other)
    # one timed-out request opens the breaker (kvbm/object_pool.py), then `other` is computed as it was cold; 2x each
    assert time.monotonic() - started < 2 * (cold_s + timeout_s)
    assert stalled["text_output"] == expected_other["text_output"]
    assert stalled["num_cached_tokens"] == 0
    assert series(second, "kvbm_object_store_up") == 0
    assert series(second, "kvbm_object_requests_total", outcome="timeout") >= 1


def test_a_graceful_stop_uploads_the_g2_blocks_the_bucket_lacks(strata, tmp_path, proxy) -> None:
    """The uploads of a prompt's blocks fail (the store refuses connections) as G1 evicts them into G2; the store
    comes back; SIGTERM: the server uploads the G2 blocks the bucket lacks before it leaves the segment, and a
    second server (its own G2, no G3, no Redis) answers that prompt from the bucket."""
    # G1 holds a prompt and a half: the first is evicted to G2
    repository = smollm2_repository(tmp_path, max_model_len=1024, max_concurrent_requests=1, num_kv_blocks=40)
    url = f"s3://{BUCKET}/stop-{uuid.uuid4().hex[:8]}"
    tiers = ("--kvbm-object-url", url, "--kvbm-host-cache-gb", "0.1", "--kvbm-object-timeout-secs", "1")
    first = strata(repository, *tiers, "--kvbm-cache-id", f"a-{uuid.uuid4().hex[:8]}")
    prompt = document("the printing press")
    proxy.mode = "refuse"
    expected = generate(first, prompt)
    for topic in ("the steam engine", "the telegraph"):  # evict all of `prompt` to G2; its uploads fail
        generate(first, document(topic))
    assert series(first, "kvbm_object_store_up") == 0
    puts = series(first, "kvbm_object_requests_total", op="put")
    assert puts >= 1 and series(first, "kvbm_object_requests_total", op="put", outcome="ok") == 0

    proxy.mode = "pass"
    pokes = itertools.count()

    def store_up() -> bool:
        if series(first, "kvbm_object_store_up") == 1:
            return True
        poke = next(pokes)  # a miss's lookup is the breaker's probe once its open period ends
        generate(first, f"Poke {poke}: list the first twenty prime numbers, separated by commas, please.")
        return False

    # the breaker is in the server process: polling its metric is the only way to see it close; its open period
    # doubles up to CIRCUIT_MAX_S while failures go on, so twice that bounds the wait
    wait_for(store_up, 2 * CIRCUIT_MAX_S, what="the breaker's probe to find the store up")
    assert first.stop(signal.SIGTERM) == 0

    second = strata(repository, *tiers, "--kvbm-cache-id", f"b-{uuid.uuid4().hex[:8]}")
    answer = generate(second, prompt)
    assert answer["text_output"] == expected["text_output"]
    assert answer["num_cached_tokens"] >= 16 * 24, answer["num_cached_tokens"]
    assert series(second, "kvbm_onboard_blocks_total", direction="G5->G1") >= 24
