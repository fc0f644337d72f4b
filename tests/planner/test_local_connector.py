"""The local connector and the planner inside `strata serve`, on real parts: `strata serve --accept-remote-workers`,
`strata worker` processes with the real SmolLM2, a real Redis."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from harness.metrics import samples, scrape
from harness.servers import copy_models, start_strata
from harness.waiting import wait_for
from server.planner.local import LocalConnector, RedisLeadership


def test_one_planner_holds_the_redis_lease(redis_url) -> None:
    first, second = (RedisLeadership(redis_url, "m", lease_s=0.5, identity=name) for name in ("a", "b"))
    assert first.is_leader() and not second.is_leader()
    assert first.is_leader()  # renewed
    first.release()
    assert second.is_leader() and not first.is_leader()
    time.sleep(0.7)  # the lease runs out without renewal: the other planner takes it
    assert first.is_leader()
    assert not RedisLeadership(
        "redis://127.0.0.1:1", "m", 1.0
    ).is_leader()  # unreachable: not leader, no raise


@pytest.fixture
def short_tmp(tmp_path_factory) -> Path:
    """A short folder name: Triton's unix socket paths under it must stay under the AF_UNIX limit."""
    return tmp_path_factory.mktemp("planner")


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="unused", timeout=120, max_retries=0
    )


def stream(client: openai.OpenAI, prompt: str, tokens: int) -> tuple[int, str]:
    """Completion tokens received and the finish reason of one streamed completion."""
    received, reason = 0, None
    chunks = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            received = chunk.usage.completion_tokens
    return received, reason


# seconds, on a loaded 2-core host: a server or a `strata worker` starting (load, calibrate, join); a 48-token
# stream, which is also the drain deadline of the test's workers
WORKER_START_S = 300
STREAM_TIMEOUT_S = 120


@pytest.mark.slow
def test_scale_up_then_down_while_clients_stream_loses_nothing(short_tmp, redis_url) -> None:
    """A worker drained by a scale-down while two streams run on it finishes them there: nothing lost, nothing
    migrated. Each step waits on what the server reports (its router's workers and their requests), so a
    loaded host only makes it slower; the drain deadline outlasts the streams (past it they would migrate)."""
    repository = copy_models(short_tmp / "repo", "smollm2")
    server = start_strata(repository, short_tmp, "--workers", "0", "--no-kvbm", "--redis-url", redis_url,
                          "--accept-remote-workers", "--routing-strategy", "round-robin",
                          ready_timeout_s=WORKER_START_S)  # fmt: skip
    connector = LocalConnector(
        repository, "smollm2", redis_url, ["--no-kvbm"], exit_timeout_s=STREAM_TIMEOUT_S
    )
    client = client_of(server)
    try:
        connector.scale("both", 1)
        (first,) = _routed_workers(server, connector, 1)
        assert stream(client, "Hello", 4) == (4, "length")
        connector.scale("both", 2)
        assert connector.workers()["both"] == 2
        (newest,) = _routed_workers(server, connector, 2).keys() - {first}
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(stream, client, f"Story {i}:", 48) for i in range(4)]
            wait_for(
                lambda: _worker_in_flight(server) == {first: 2, newest: 2}, 60, what="2 streams per worker"
            )
            connector.scale("both", 1)  # the newest worker drains while its two streams run
            assert connector.workers()["both"] == 1
            assert [s.result(STREAM_TIMEOUT_S) for s in streams] == [(48, "length")] * 4
        log = server.log()
        assert f"worker {newest} is draining (worker shutting down): 2 request(s) to finish there" in log
        assert f"worker {newest} is draining: no new requests go to it" in log
        assert "migrated" not in log  # they finished where they ran
        wait_for(lambda: not connector._draining or all(p.poll() == 0 for p in connector._draining), 30,
                 what="drained worker exited")  # fmt: skip
        assert stream(client, "Still here?", 4) == (4, "length")
    finally:
        client.close()
        server.stop()
        connector.close(stop_workers=True)


def _routed_workers(server, connector: LocalConnector, count: int) -> dict[str, float]:
    """`_worker_in_flight` once the router routes to `count` workers; fails at once if a worker process exits."""
    wait_for(
        lambda: len(_worker_in_flight(server)) == count or connector.workers()["both"] < count,
        WORKER_START_S,
        what=f"{count} worker(s) in the router",
    )
    assert connector.workers()["both"] == count, "a worker process exited before joining"
    return _worker_in_flight(server)


def _worker_in_flight(server) -> dict[str, float]:
    """The router's requests in flight per worker it routes to (draining and dead workers are not listed)."""
    found = samples(scrape(server.openai_url), "strata_router_worker_in_flight")
    return {labels["worker"]: count for labels, count in found}


PROFILE = """{"prefill": [{"prompt_tokens": 128, "ttft_s": 0.2}, {"prompt_tokens": 1024, "ttft_s": 1.6}],
 "decode": [{"concurrency": 1, "context_tokens": 256, "itl_s": 0.05},
            {"concurrency": 8, "context_tokens": 256, "itl_s": 0.2}]}"""


@pytest.mark.slow
def test_serve_with_the_planner_starts_its_workers_and_stops_them(short_tmp, redis_url) -> None:
    repository = copy_models(short_tmp / "repo", "smollm2")
    profile = short_tmp / "profile.json"
    profile.write_text(PROFILE)
    server = start_strata(
        repository, short_tmp, "--workers", "0", "--no-kvbm", "--redis-url", redis_url, "--accept-remote-workers",
        "--planner", "smollm2", "--planner-profile", str(profile), "--ttft-target", "2", "--itl-target", "0.5",
        "--adjustment-interval", "1", "--min-workers", "1", "--max-workers", "1",
        "--planner-worker-args", "--no-kvbm --lease-secs 2",
    )  # fmt: skip
    client = client_of(server)
    try:
        wait_for(lambda: "joined" in server.log(), 90, what="the planner's worker joined")
        assert stream(client, "Hello", 4) == (4, "length")
        text = scrape(server.openai_url)
        assert 'strata_planner_workers{model="smollm2",role="both"} 1.0' in text
        assert 'strata_planner_leader{model="smollm2"} 1.0' in text
        assert "planner smollm2: observed" in server.log()
    finally:
        client.close()
        assert server.stop() == 0
    worker_tag = f"smollm2-both-{server.process.pid}-"
    wait_for(
        lambda: not _processes_with(worker_tag), 30, what="the planner's workers stopped with the server"
    )


def _processes_with(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(pid))
        except OSError:
            continue
    return found
