"""Worker processes behind RemoteEngine, and RoutedEngine over them with the KVBM index fed by their events."""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest

from harness.ports import free_port
from harness.waiting import wait_for
from kvbm.block_hash import block_hashes
from kvbm.index import KVIndex
from server.engine.api import (
    EngineOverloaded,
    GenerationOutput,
    GenerationRequest,
    RequestError,
    RequestId,
    SamplingParams,
)
from server.openai.app import build_app
from server.openai.metrics import FrontendMetrics
from server.router.config import RouterConfig
from server.router.metrics import RouterMetrics
from server.router.routed import RoutedEngine
from server.router.router import Router
from server.workers.protocol import WorkerId
from server.workers.remote import RemoteEngine, WorkerDied, spawn_workers
from server.workers.worker import WorkerSpec
from tests.workers.worker_fakes import SALT, StepEngine, broken_factory

HEARTBEAT_TIMEOUT_S = 10.0  # the killed worker's: its death must be seen long before it


def request(request_id: str, prompt: list[int], max_tokens: int = 3) -> GenerationRequest:
    return GenerationRequest(RequestId(request_id), prompt, SamplingParams(max_tokens=max_tokens))


def collect(outputs: queue.SimpleQueue[GenerationOutput], timeout_s: float = 10.0) -> list[GenerationOutput]:
    """Outputs until the finished one, waiting at most `timeout_s` for each."""
    got = [outputs.get(timeout=timeout_s)]
    while not got[-1].finished:
        got.append(outputs.get(timeout=timeout_s))
    return got


@pytest.fixture(scope="module")
def worker() -> Iterator[RemoteEngine]:
    remote = RemoteEngine.spawn(WorkerId("w0"), WorkerSpec(StepEngine, (0.005,)), heartbeat_timeout_s=2.0)
    yield remote
    remote.close()


def test_remote_engine_round_trip(worker: RemoteEngine) -> None:
    assert (worker.model_name, worker.max_model_len, worker.max_tokens_limit) == ("step", 256, 200)
    assert worker.info.block_size == 4 and worker.info.salt == SALT
    assert worker.encode("ab") == [97, 98]
    assert worker.apply_chat_template([{"role": "user", "content": "a"}]) == list(b"<user>a")
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    worker.submit(request("r1", [1, 2, 3]), outputs.put)
    got = collect(outputs)
    assert "".join(o.new_text for o in got) == " t0 t1 t2"
    assert (got[-1].finish_reason, got[-1].num_output_tokens) == ("length", 3)


def test_request_error_comes_back_with_its_field(worker: RemoteEngine) -> None:
    with pytest.raises(RequestError) as raised:
        worker.submit(request("r2", [1] * 300), lambda _: None)
    assert raised.value.field == "prompt"


def test_a_full_worker_refuses_with_engine_overloaded() -> None:
    remote = RemoteEngine.spawn(
        WorkerId("w-full"),
        WorkerSpec(functools.partial(StepEngine, max_running=1), (0.01,)),
        heartbeat_timeout_s=2.0,
    )
    try:
        remote.submit(request("long", [1, 2], max_tokens=200), lambda _: None)
        with pytest.raises(EngineOverloaded, match="1 requests running") as refused:
            remote.submit(request("refused", [1, 2]), lambda _: None)
        assert refused.value.retry_after_s == 1.5 and remote.alive
    finally:
        remote.close()


def test_abort_reaches_the_worker(worker: RemoteEngine) -> None:
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    worker.submit(request("r3", [1, 2], max_tokens=200), outputs.put)
    assert not outputs.get(timeout=10).finished
    worker.abort(RequestId("r3"))
    assert collect(outputs)[-1].finish_reason == "abort"


def test_heartbeats_carry_pool_stats(worker: RemoteEngine) -> None:
    wait_for(lambda: worker.stats().num_blocks == 100, 5, 0.01, what="a heartbeat")
    assert worker.stats().num_free_blocks == 100


class DeathLog:
    """A WorkerListener that notes deaths."""

    def __init__(self) -> None:
        self.worker_ids: list[str] = []

    def on_beat(self, worker: RemoteEngine) -> None:
        pass

    def on_death(self, worker: RemoteEngine) -> None:
        self.worker_ids.append(worker.worker_id)


def test_killed_worker_is_detected_and_its_requests_fail() -> None:
    remote = RemoteEngine.spawn(
        WorkerId("w-kill"), WorkerSpec(StepEngine, (0.01,)), heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S
    )
    deaths = DeathLog()
    remote.add_listener(deaths)
    try:
        outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
        remote.submit(request("r1", [1], max_tokens=200), outputs.put)
        outputs.get(timeout=10)
        killed_at = time.monotonic()
        remote.kill()
        last = collect(outputs, timeout_s=5)[-1]
        detected_s = time.monotonic() - killed_at
        assert (last.finish_reason, deaths.worker_ids, remote.alive) == ("error", ["w-kill"], False)
        # seen through the process's exit, not through missed heartbeats (whose timeout is 10 s here)
        assert detected_s < HEARTBEAT_TIMEOUT_S / 2
        with pytest.raises(WorkerDied):
            remote.submit(request("r2", [1]), outputs.put)
    finally:
        remote.close()


def test_hung_worker_is_declared_dead_after_missed_heartbeats() -> None:
    remote = RemoteEngine.spawn(
        WorkerId("w-hang"), WorkerSpec(StepEngine, (0.01,), heartbeat_s=0.2), heartbeat_timeout_s=1.0
    )
    try:
        os.kill(remote.info.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_for(lambda: not remote.alive, 30, interval=0.02, what="the hung worker declared dead")
        assert time.monotonic() - stopped_at < 2 * 1.0  # twice its heartbeat timeout
    finally:
        remote.close()


def test_engine_that_fails_to_build_is_reported() -> None:
    with pytest.raises(WorkerDied, match="no weights here"):
        RemoteEngine.spawn(WorkerId("w-broken"), WorkerSpec(broken_factory))


def test_routed_engine_keeps_a_conversation_on_the_worker_that_holds_it() -> None:
    index = KVIndex()
    router = Router(RouterConfig(), index)
    spec = WorkerSpec(StepEngine, (0.002,), forward_events=True)
    workers = spawn_workers([WorkerId("w0"), WorkerId("w1")], spec, event_sink=index)
    try:
        routed = RoutedEngine(workers, router, block_size=4, salt=SALT)
        outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
        turn = list(range(40))
        routed.submit(request("c1", turn), outputs.put)
        collect(outputs)
        for i in range(4):
            turn = turn + list(range(100 + 10 * i, 110 + 10 * i))
            routed.submit(request(f"c{i + 2}", turn), outputs.put)
            collect(outputs)
        assert index.events_applied == 2 + 5  # two announcements while starting, one event per turn
        assert _decisions(router)[("kv-aware", "prefix_hit")] == 4
        holders = index.query(block_hashes(turn, 4, SALT)).workers
        assert len(holders) == 1  # every turn went to the worker that held the conversation
        assert (
            'strata_router_worker_active_blocks{worker="w0"} 0.0'
            in generate_latest(router.metrics.registry).decode()
        )
    finally:
        for remote in workers:
            remote.close()


def _decisions(router: Router) -> dict[tuple[str, str], float]:
    samples = router.metrics.decisions.collect()[0].samples
    return {(s.labels["strategy"], s.labels["reason"]): s.value for s in samples if s.name.endswith("_total")}


@contextlib.contextmanager
def _serve(app: object) -> Iterator[str]:
    """uvicorn on a free port in a thread; always stopped."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        # uvicorn sets `started` and signals nothing: polled, with a deadline
        wait_for(lambda: server.started or not thread.is_alive(), 10, 0.01, what="uvicorn started")
        assert server.started
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_openai_frontend_over_routed_worker_processes() -> None:
    registry = CollectorRegistry()
    index = KVIndex()
    router = Router(RouterConfig(), index, RouterMetrics.create(registry))
    spec = WorkerSpec(StepEngine, (0.002,), forward_events=True)
    workers = spawn_workers([WorkerId("w0"), WorkerId("w1")], spec, event_sink=index)
    routed = RoutedEngine(workers, router, block_size=4, salt=SALT)
    try:
        app = build_app({"step": routed}, FrontendMetrics.create(registry))
        with _serve(app) as base_url:
            client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
            messages = [
                {"role": "system", "content": "You are a routing test."},
                {"role": "user", "content": "hi"},
            ]
            first = client.chat.completions.create(model="step", messages=messages, max_tokens=3)
            assert first.choices[0].message.content == " t0 t1 t2"
            messages += [{"role": "assistant", "content": "t0 t1 t2"}, {"role": "user", "content": "more"}]
            chunks = list(
                client.chat.completions.create(model="step", messages=messages, max_tokens=2, stream=True)
            )
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " t0 t1"
            with pytest.raises(openai.BadRequestError):
                client.completions.create(model="step", prompt="x", max_tokens=500)
            metrics = httpx.get(f"{base_url}/metrics").text
        assert 'strata_router_decisions_total{reason="prefix_hit",strategy="kv-aware"} 1.0' in metrics
        assert 'strata_requests_total{model="step",status="success"} 2.0' in metrics
    finally:
        routed.close()
    assert not any(worker.alive for worker in workers)


def test_a_dropped_worker_ends_its_requests_as_retryable() -> None:
    """Dropping a worker (its lease is gone) lets the router resume its requests elsewhere; closing it does not."""
    remote = RemoteEngine.spawn(WorkerId("w-drop"), WorkerSpec(StepEngine, (0.01,)), heartbeat_timeout_s=2.0)
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    remote.submit(request("long", [1, 2], max_tokens=200), outputs.put)
    outputs.get(timeout=30)
    remote.drop("its lease is gone")
    last = collect(outputs)[-1]
    assert last.finish_reason == "error" and last.retryable and "lease is gone" in last.error
    assert not remote.alive


def test_a_close_while_a_death_is_reported_keeps_every_request_retryable() -> None:
    """A worker killed with two requests running: while its death goes out to their sinks, the worker is closed
    (as discovery forgets a worker whose bye is being handled). Both requests still end retryable, so the router
    resumes both; before, the second one became a final error."""
    remote = RemoteEngine.spawn(WorkerId("w-race"), WorkerSpec(StepEngine, (0.01,)))
    streaming: set[str] = set()
    finals: list[GenerationOutput] = []
    closer = threading.Thread(target=remote.close, kwargs={"timeout_s": 5})

    def sink(output: GenerationOutput) -> None:
        if not output.finished:
            streaming.add(output.request_id)
            return
        finals.append(output)
        if len(finals) == 1:  # the first request's death report: another thread closes the worker meanwhile
            closer.start()
            # close() marks the worker closing first, then waits for this thread: the second report goes out
            # only after that mark, so every run exercises the race
            wait_for(lambda: remote._closing, 10, 0.005, what="close() under way")

    remote.submit(request("a", [1], max_tokens=200), sink)
    remote.submit(request("b", [2], max_tokens=200), sink)
    wait_for(lambda: streaming == {"a", "b"}, 10, what="both requests streaming")
    remote.kill()
    wait_for(lambda: len(finals) == 2, 10, what="both requests ended")
    closer.join(10)
    assert [(out.finish_reason, out.retryable) for out in finals] == [("error", True), ("error", True)]


def test_a_worker_dying_during_a_submit_fails_the_submit_and_sends_nothing_to_its_sink() -> None:
    """The caller of a submit the worker never accepted gets WorkerDied (the router tries another worker); its sink
    must not also get an error, which would reach the client of the retried request."""
    remote = RemoteEngine.spawn(
        WorkerId("w-slow"),
        WorkerSpec(functools.partial(StepEngine, submit_s=30.0), (0.01,)),
        heartbeat_timeout_s=2.0,
    )
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    threading.Timer(1.0, remote.kill).start()
    with pytest.raises(WorkerDied):
        remote.submit(request("pending", [1, 2]), outputs.put)
    assert outputs.empty()
    remote.close()
