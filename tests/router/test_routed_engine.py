"""RoutedEngine over in-process workers: routing, release, abort, dead workers, speed measurement."""

from __future__ import annotations

import queue
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from kvbm.block_hash import BlockHash, block_hashes, request_salt
from kvbm.index import KVIndex
from server.engine.api import (
    EngineOverloaded,
    GenerationOutput,
    GenerationRequest,
    KVBlockLayout,
    LocalEngine,
    OutputSink,
    PoolStats,
    RequestError,
    RequestId,
    SamplingParams,
)
from server.engine.config import EngineConfig
from server.router.config import RouterConfig
from server.router.routed import RoutedEngine
from server.router.router import RouteDecision, Router
from server.router.speed import SpeedMeter
from server.workers.hardware import HardwareInfo, Speeds
from server.workers.protocol import WorkerId, WorkerInfo
from server.workers.remote import WorkerListener
from server.workers.worker import build_llm_engine
from tests.workers.worker_fakes import SALT, StepEngine

MODEL_CACHE = Path(__file__).resolve().parents[2] / ".strata-cache" / "models"  # shared with tests/engine


class LocalWorker:
    """An engine in this process (a StepEngine unless given one) with the members of a RemoteEngine
    (server.router.membership.RoutableWorker)."""

    def __init__(self, worker_id: str, index: KVIndex, engine: LocalEngine | None = None) -> None:
        self.worker_id = WorkerId(worker_id)
        self.engine = engine or StepEngine(0.002, worker_id=worker_id, events=index)
        self.model_name, self.max_model_len = self.engine.model_name, self.engine.max_model_len
        self.max_tokens_limit = self.engine.max_tokens_limit
        self.block_layout: KVBlockLayout = self.engine.block_layout
        self.info = WorkerInfo(
            self.model_name,
            self.max_model_len,
            self.max_tokens_limit,
            self.block_layout.block_size,
            self.block_layout.salt,
            1,
        )
        self.alive = True
        self.submitted: list[RequestId] = []
        self.aborted: list[RequestId] = []
        self.listeners: list[WorkerListener] = []

    @property
    def healthy(self) -> bool:
        return self.alive

    def add_listener(self, listener: WorkerListener) -> None:
        self.listeners.append(listener)

    def stats(self) -> PoolStats:
        return PoolStats(
            num_blocks=100,
            num_free_blocks=100,
            num_cached_blocks=0,
            num_running=0,
            num_waiting=0,
            num_preemptions=0,
        )

    def close(self) -> None:
        self.engine.close()

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], tools=None) -> list[int]:
        return self.engine.apply_chat_template(messages)

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        self.submitted.append(request.request_id)
        self.engine.submit(request, sink)

    def abort(self, request_id: RequestId) -> None:
        self.aborted.append(request_id)
        self.engine.abort(request_id)


def _setup(workers: int = 2) -> tuple[RoutedEngine, Router, list[LocalWorker]]:
    index = KVIndex()
    router = Router(RouterConfig(), index)
    local = [LocalWorker(f"w{i}", index) for i in range(workers)]
    return RoutedEngine(local, router, block_size=4, salt=SALT), router, local


def _request(
    request_id: str, prompt: list[int], max_tokens: int = 2, cache_salt: str | None = None
) -> GenerationRequest:
    return GenerationRequest(RequestId(request_id), prompt, SamplingParams(max_tokens=max_tokens), cache_salt)


def _finish(outputs: queue.SimpleQueue[GenerationOutput]) -> GenerationOutput:
    while not (output := outputs.get(timeout=10)).finished:
        pass
    return output


def test_follow_up_goes_to_the_holder_and_load_is_released() -> None:
    routed, router, workers = _setup()
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    routed.submit(_request("a", list(range(40))), outputs.put)
    _finish(outputs)
    routed.submit(_request("b", list(range(48))), outputs.put)
    _finish(outputs)
    holder = next(w for w in workers if "a" in w.submitted)
    assert "b" in holder.submitted
    assert all(load.routed_blocks == 0 and load.pending_prefill == 0 for load in router._workers.values())


def _record_routes(monkeypatch: pytest.MonkeyPatch, router: Router) -> dict[str, tuple[RouteDecision, list]]:
    """Each request's route decision and the block hashes the router was given, by request id."""
    routes: dict[str, tuple[RouteDecision, list]] = {}
    route = router.route

    def recorded(request_id: str, block_hashes: Sequence[BlockHash], exclude=()) -> RouteDecision:
        routes[request_id] = (decision := route(request_id, block_hashes, exclude)), list(block_hashes)
        return decision

    monkeypatch.setattr(router, "route", recorded)
    return routes


def test_the_router_hashes_from_the_request_salt(monkeypatch: pytest.MonkeyPatch) -> None:
    routed, router, _ = _setup()
    routes = _record_routes(monkeypatch, router)
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    prompt = list(range(40))  # 10 blocks
    for request_id, cache_salt in (("a", "tenant-a"), ("b", "tenant-b"), ("plain", None)):
        routed.submit(_request(request_id, prompt, cache_salt=cache_salt), outputs.put)
        _finish(outputs)
    assert routes["a"][1] == block_hashes(prompt, 4, request_salt(SALT, "tenant-a"))
    assert routes["plain"][1] == block_hashes(prompt, 4, SALT)  # unsalted hashes are what they always were
    assert not {*routes["a"][1]} & {*routes["b"][1]} and not {*routes["a"][1]} & {*routes["plain"][1]}
    with pytest.raises(RequestError) as raised:
        routed.submit(_request("bad", prompt, cache_salt=""), outputs.put)
    assert raised.value.field == "cache_salt" and "bad" not in routes


def test_the_router_hashes_a_salted_prompt_as_the_engine_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real LLMEngine whose KVBM agent publishes to the router's index: the router's hashes of a salted prompt
    are the blocks the engine stored, so a same-salt follow-up finds its whole prefix and another salt none."""
    index = KVIndex()
    config = EngineConfig(
        cache_dir=str(MODEL_CACHE),
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        max_model_len=512,
        max_tokens_limit=8,
        num_threads=2,
    )
    engine = build_llm_engine(config, worker_id="real", events=index)
    try:
        router = Router(RouterConfig(), index)
        worker = LocalWorker("real", index, engine)
        routed = RoutedEngine(
            [worker], router, worker.block_layout.block_size, BlockHash(worker.block_layout.salt)
        )
        routes = _record_routes(monkeypatch, router)
        prompt = engine.encode(
            "Tenants must not learn about each other's prompts from the prefix cache. " * 5
        )
        outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
        for request_id, cache_salt in (
            ("a", "tenant-a"),
            ("a-again", "tenant-a"),
            ("b", "tenant-b"),
            ("plain", None),
        ):
            routed.submit(_request(request_id, prompt, cache_salt=cache_salt), outputs.put)
            assert _finish(outputs).finish_reason == "length"
        stored = set(engine.block_manager.cached)  # type: ignore[attr-defined]
        assert routes["a"][1] and set(routes["a"][1]) <= stored
        reusable = {request_id: decision.reusable_blocks for request_id, (decision, _) in routes.items()}
        assert reusable == {"a": 0, "a-again": len(routes["a"][1]), "b": 0, "plain": 0}
    finally:
        engine.close()


def test_abort_reaches_the_worker_that_runs_the_request() -> None:
    routed, router, workers = _setup()
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    routed.submit(_request("long", [1, 2, 3], max_tokens=200), outputs.put)
    outputs.get(timeout=10)
    routed.abort(RequestId("long"))
    assert _finish(outputs).finish_reason == "abort"
    assert [w.aborted for w in workers if w.submitted] == [[RequestId("long")]]
    assert all(load.routed_requests == 0 for load in router._workers.values())


def test_a_dead_worker_leaves_the_router() -> None:
    routed, router, workers = _setup()
    workers[0].alive = False
    routed.membership.on_death(workers[0])
    assert router.workers == ["w1"]
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    routed.submit(_request("x", [5] * 8), outputs.put)
    _finish(outputs)
    assert workers[1].submitted == ["x"]
    assert routed.encode("a") == [97]  # tokenizes on a live worker


def test_speeds_are_measured_only_from_requests_that_had_the_worker_alone() -> None:
    routed, _, _ = _setup(workers=1)
    speed = routed.membership.meter(WorkerId("w0"))
    speed.min_samples, speed.min_prefill_tokens, speed.min_decode_tokens = (
        1,
        1,
        1,
    )  # the step engine's tiny prompts
    first: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    routed.submit(_request("first", list(range(40)), max_tokens=50), first.put)
    first.get(timeout=10)
    measured = speed.prefill_tok_s
    assert measured > 0
    queued: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    routed.submit(_request("queued", list(range(100, 140))), queued.put)
    _finish(queued)
    assert speed.prefill_tok_s == measured  # it found the worker busy: its TTFT is not a prefill speed
    _finish(first)
    assert speed.decode_tok_s == 0  # "first" shared its worker while decoding
    alone: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    routed.submit(_request("alone", list(range(200, 240)), max_tokens=5), alone.put)
    _finish(alone)
    assert speed.decode_tok_s > 0


def test_speed_is_unknown_until_enough_samples() -> None:
    routed, _, _ = _setup(workers=1)
    speed = routed.membership.meter(WorkerId("w0"))
    speed.min_prefill_tokens = speed.min_decode_tokens = 1
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    for i in range(3):
        assert speed.prefill_tok_s == 0
        routed.submit(_request(f"r{i}", list(range(i * 50, i * 50 + 40))), outputs.put)
        _finish(outputs)
    assert speed.prefill_tok_s > 0 and speed.decode_tok_s > 0


def test_a_mostly_cached_prompt_is_not_a_prefill_speed_sample() -> None:
    """16 uncached tokens in a step's time would read as a slow worker and push its conversations away."""
    speed = SpeedMeter(min_samples=1)
    speed.add_prefill(512, 1.0)
    speed.add_prefill(16, 0.2)  # a follow-up turn that found 496 of 512 tokens cached: 80 tok/s
    assert speed.prefill_tok_s == 512
    speed.add_decode(2, 1.0)  # one decode step after the first token: mostly request overhead
    assert speed.decode_tok_s == 0
    speed.add_decode(16, 0.5)
    assert speed.decode_tok_s == 32


def _described(worker_id: str, index: KVIndex, host: str, prefill_tok_s: float) -> LocalWorker:
    worker = LocalWorker(worker_id, index)
    hardware = HardwareInfo(host, "cpu", "Test CPU", "Test CPU", 2, 1, 2**34, 0, 100, 100 * 4096)
    worker.info = WorkerInfo(
        worker.model_name,
        worker.max_model_len,
        worker.max_tokens_limit,
        4,
        SALT,
        1,
        hardware,
        Speeds(prefill_tok_s, 20.0),
    )
    return worker


def test_twin_workers_on_one_host_share_their_speed_meter() -> None:
    """One unlucky calibration (taken while its twins were loading) must not make one of identical workers on a
    shared machine look slow for the whole run; another host's worker keeps its own speed."""
    index = KVIndex()
    router = Router(RouterConfig(), index)
    workers = [
        _described("a0", index, "host-a", 150.0),
        _described("a1", index, "host-a", 270.0),
        _described("b0", index, "host-b", 600.0),
    ]
    routed = RoutedEngine(workers, router, block_size=4, salt=SALT)
    a0, a1, b0 = (routed.membership.meter(WorkerId(w)) for w in ("a0", "a1", "b0"))
    assert a0 is a1 and a0 is not b0
    assert a0.prefill_tok_s == 150.0 * 0.8 + 270.0 * 0.2  # the second calibration is one more sample
    loads = {load.stats.worker_id: load for load in router._workers.values()}
    assert loads["a0"].prefill_speed == loads["a1"].prefill_speed < loads["b0"].prefill_speed


def test_a_worker_with_a_full_queue_passes_the_request_to_the_next() -> None:
    """A worker that refuses with EngineOverloaded is skipped (and counted); when every worker refuses, the
    caller gets EngineOverloaded and the router holds nothing for the request."""
    routed, router, workers = _setup(3)
    full: set[str] = set()

    def refusing(worker: LocalWorker):
        real = worker.submit

        def submit(request: GenerationRequest, sink: OutputSink) -> None:
            if worker.worker_id in full:
                raise EngineOverloaded(f"{worker.worker_id} is full", retry_after_s=2.0)
            real(request, sink)

        return submit

    for worker in workers:
        worker.submit = refusing(worker)  # type: ignore[method-assign]
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    full.update({"w0", "w1"})
    routed.submit(_request("a", list(range(40))), outputs.put)
    assert _finish(outputs).finish_reason == "length"
    assert "a" in workers[2].submitted
    full.add("w2")
    with pytest.raises(EngineOverloaded, match="every worker") as refused:
        routed.submit(_request("b", list(range(40))), outputs.put)
    assert refused.value.retry_after_s == 2.0
    assert all(load.routed_blocks == 0 and load.pending_prefill == 0 for load in router._workers.values())
    assert sum(router.metrics.worker_queue_full.labels(f"w{i}")._value.get() for i in range(3)) >= 5


def test_a_dead_twin_stays_out_of_the_router_when_another_twin_joins() -> None:
    """Twins share a speed meter and a joining twin refreshes the others' router entries: a dead one must not be
    put back (the router would send new requests and migrations to it)."""
    index = KVIndex()
    router = Router(RouterConfig(), index)
    a0, a1 = _described("a0", index, "host-a", 200.0), _described("a1", index, "host-a", 200.0)
    routed = RoutedEngine([a0, a1], router, block_size=4, salt=SALT)
    a1.alive = False
    routed.membership.on_death(a1)
    routed.add_worker(_described("remote", index, "host-a", 200.0))
    assert set(router._workers) == {"a0", "remote"}
