"""RoutedEngine's disaggregated flow with scripted workers (no engine): what the router does at each answer of a
prefill worker (handoff, first-token stop, refusal, death) and of the decode worker, and the queue it keeps."""

from __future__ import annotations

import queue
from dataclasses import replace

import pytest

from kvbm.index import KVIndex
from kvbm.transfer_params import KVHandoff, RemoteDecode, decode_transfer_params, encode_transfer_params
from server.engine.api import (
    EngineOverloaded,
    GenerationOutput,
    GenerationRequest,
    KVBlockLayout,
    OutputSink,
    PoolStats,
    RequestId,
    SamplingParams,
)
from server.router.config import RouterConfig
from server.router.disagg import DisaggConfig, DisaggRule
from server.router.routed import RoutedEngine
from server.router.router import Router
from server.workers.hardware import HardwareInfo
from server.workers.protocol import WorkerId, WorkerInfo
from tests.workers.worker_fakes import SALT

BLOCK = 4
HOST = HardwareInfo(host="node-a", device="cpu", device_name="fake", cpu_model="fake", cpu_cores=2, torch_threads=1, device_memory_bytes=0,
                    memory_bytes=1 << 30, kv_capacity_blocks=100, kv_capacity_bytes=1 << 20)  # fmt: skip


class ScriptedWorker:
    """A RoutableWorker whose answers the test sends (`answer`); `refuse` makes its next submit raise."""

    def __init__(self, worker_id: str, role: str) -> None:
        self.worker_id = WorkerId(worker_id)
        self.model_name, self.max_model_len, self.max_tokens_limit = "m", 4096, 512
        self.block_layout = KVBlockLayout(BLOCK, SALT)
        self.info = WorkerInfo("m", 4096, 512, BLOCK, SALT, 1, HOST, role=role)
        self.alive = True
        self.requests: list[GenerationRequest] = []
        self.sinks: dict[RequestId, OutputSink] = {}
        self.aborted: list[RequestId] = []
        self.listeners = []
        self.refuse: Exception | None = None

    healthy = property(lambda self: self.alive)

    def add_listener(self, listener) -> None:
        self.listeners.append(listener)

    def stats(self) -> PoolStats:
        return PoolStats(100, 100, 0, 0, 0, 0)

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        if self.refuse is not None:
            refusal, self.refuse = self.refuse, None
            raise refusal
        self.requests.append(request)
        self.sinks[request.request_id] = sink

    def answer(self, request_id: str, output: GenerationOutput) -> None:
        self.sinks[RequestId(request_id)](output)

    def abort(self, request_id: RequestId) -> None:
        self.aborted.append(request_id)

    def die(self) -> None:
        self.alive = False
        for listener in self.listeners:
            listener.on_death(self)
        for request_id, sink in list(self.sinks.items()):
            sink(GenerationOutput(request_id, [], "", True, "error", error="died", retryable=True))

    def encode(self, text: str) -> list[int]:
        return [1] * len(text)

    def close(self) -> None:
        pass


def cluster(prefill: int = 2, decode: int = 1, **rule) -> tuple[RoutedEngine, list[ScriptedWorker]]:
    workers = [ScriptedWorker(f"p{i}", "prefill") for i in range(prefill)]
    workers += [ScriptedWorker(f"d{i}", "decode") for i in range(decode)]
    index = KVIndex()
    config = DisaggConfig(**{"max_local_prefill_length": 8, "max_prefill_queue_size": 4, **rule})
    routed = RoutedEngine(
        workers, Router(RouterConfig(), index), BLOCK, SALT,
        prefill_router=Router(RouterConfig(), index), disagg=DisaggRule(config),
    )  # fmt: skip
    return routed, workers


def request(name: str, tokens: int, max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(
        RequestId(name), list(range(10, 10 + tokens)), SamplingParams(max_tokens=max_tokens)
    )


def handoff_output(name: str, first: int = 7) -> GenerationOutput:
    handoff = KVHandoff("shm", "strata-kvx-1-0123456789abcdef-0", [1, 2], 64, [first], 0, 1500, 128)
    return GenerationOutput(RequestId(name), [first], "x", True, None, 20, 0, 1,
                            kv_transfer_params=encode_transfer_params(handoff))  # fmt: skip


def params_of(sent: GenerationRequest):
    return decode_transfer_params(sent.kv_transfer_params)


def drain(outputs: queue.SimpleQueue) -> list[GenerationOutput]:
    seen = []
    while not outputs.empty():
        seen.append(outputs.get_nowait())
    return seen


def prefill_count(routed: RoutedEngine, where: str, reason: str) -> float:
    labels = {"model": "m", "where": where, "reason": reason}
    return routed.router.metrics.registry.get_sample_value("strata_disagg_prefills_total", labels) or 0


def queue_depth(routed: RoutedEngine) -> float:
    return routed.router.metrics.registry.get_sample_value("strata_disagg_prefill_queue", {"model": "m"})


def test_a_long_prompt_is_prefilled_remotely_and_continues_on_the_decode_worker() -> None:
    routed, (p0, p1, d0) = cluster()
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    routed.submit(request("r", 20), outputs.put)
    prefiller = p0 if p0.requests else p1
    sent = prefiller.requests[0]
    assert params_of(sent) == RemoteDecode("node-a")
    assert queue_depth(routed) == 1 and prefill_count(routed, "remote", "long_prompt") == 1
    prefiller.answer("r", handoff_output("r"))
    first = drain(outputs)
    assert [(o.new_token_ids, o.finished, o.kv_transfer_params) for o in first] == [
        ([7], False, None)
    ]  # shown at once
    assert queue_depth(routed) == 0
    resumed = d0.requests[0]
    assert params_of(resumed).token_ids == [7]
    d0.answer("r", GenerationOutput(RequestId("r"), [8], "y", True, "length", 20, 0, 2))
    assert [o.new_token_ids for o in drain(outputs)] == [[8]]
    registry = routed.router.metrics.registry
    assert (
        registry.get_sample_value("strata_disagg_kv_transfer_bytes_total", {"model": "m", "transport": "shm"})
        == 128
    )
    assert len(routed.flights) == 0


@pytest.mark.parametrize(("tokens", "queued", "reason"), [(8, 0, "short_prompt"), (20, 4, "queue_full")])
def test_short_prompts_and_a_full_queue_prefill_on_the_decode_worker(
    tokens: int, queued: int, reason: str
) -> None:
    routed, (p0, p1, d0) = cluster()
    routed.disagg_flow.queue_depth = queued
    routed.submit(request("r", tokens), lambda output: None)
    assert d0.requests[0].kv_transfer_params is None
    assert not p0.requests and not p1.requests
    assert prefill_count(routed, "local", reason) == 1


def test_a_first_token_that_ends_the_request_is_the_answer() -> None:
    routed, (p0, p1, d0) = cluster()
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    routed.submit(request("r", 20, max_tokens=1), outputs.put)
    prefiller = p0 if p0.requests else p1
    prefiller.answer("r", GenerationOutput(RequestId("r"), [2], "", True, "stop", 20, 0, 1))
    assert [o.finish_reason for o in drain(outputs)] == ["stop"]
    assert not d0.requests and queue_depth(routed) == 0 and len(routed.flights) == 0


def test_refusing_prefill_workers_are_passed_over_then_the_decode_worker_prefills() -> None:
    routed, (p0, p1, d0) = cluster()
    p0.refuse = EngineOverloaded("full")
    p1.refuse = EngineOverloaded("full")
    routed.submit(request("r", 20), lambda output: None)
    assert not p0.requests and not p1.requests and d0.requests[0].kv_transfer_params is None
    assert prefill_count(routed, "local", "prefill_failed") == 1 and queue_depth(routed) == 0


def test_a_dead_prefill_worker_hands_the_request_to_the_other_then_to_the_decode_worker() -> None:
    routed, (p0, p1, d0) = cluster()
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    routed.submit(request("r", 20), outputs.put)
    first, second = (p0, p1) if p0.requests else (p1, p0)
    first.die()
    assert second.requests and not drain(outputs)  # prefilled again elsewhere; the client saw nothing
    second.die()
    assert d0.requests[0].kv_transfer_params is None  # no prefill worker left: locally
    assert prefill_count(routed, "local", "prefill_failed") == 1 and queue_depth(routed) == 0
    d0.answer("r", GenerationOutput(RequestId("r"), [5], "z", True, "length", 20, 0, 1))
    assert [o.finish_reason for o in drain(outputs)] == ["length"]


def test_no_prefill_worker_alive_is_the_aggregated_fallback_and_a_joining_one_is_used_again() -> None:
    routed, (p0, d0) = cluster(prefill=1)
    p0.die()
    routed.submit(request("a", 20), lambda output: None)
    assert (
        prefill_count(routed, "local", "no_prefill_worker") == 1
        and d0.requests[-1].kv_transfer_params is None
    )
    joined = ScriptedWorker("p9", "prefill")
    routed.add_worker(joined)
    routed.submit(request("b", 20), lambda output: None)
    assert joined.requests[0].request_id == "b"


def test_a_decode_worker_gone_at_handoff_passes_the_request_to_another() -> None:
    routed, (p0, d0, d1) = cluster(prefill=1, decode=2)
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    routed.submit(request("r", 20), outputs.put)
    chosen, other = (d0, d1) if routed.flights.get(RequestId("r")).decode_worker_id == "d0" else (d1, d0)
    chosen.die()
    p0.answer("r", handoff_output("r"))
    assert isinstance(params_of(other.requests[0]), KVHandoff)
    other.answer("r", GenerationOutput(RequestId("r"), [8], "y", True, "length", 20, 0, 2))
    assert [o.new_token_ids for o in drain(outputs)] == [[7], [8]]


def test_an_abort_during_the_prefill_reaches_the_prefill_worker_and_ends_the_request_once() -> None:
    routed, (p0, d0) = cluster(prefill=1)
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    routed.submit(request("r", 20), outputs.put)
    routed.abort(RequestId("r"))
    assert p0.aborted == ["r"]
    p0.answer("r", handoff_output("r"))  # the handoff crossed the abort
    seen = drain(outputs)
    assert [o.finished for o in seen] == [False, True] and seen[-1].finish_reason == "abort"
    assert not d0.requests and len(routed.flights) == 0 and queue_depth(routed) == 0


def test_only_prefill_workers_alive_is_unhealthy() -> None:
    routed, (p0, d0) = cluster(prefill=1)
    assert routed.healthy
    d0.die()
    assert not routed.healthy
    aggregated = RoutedEngine([ScriptedWorker("w0", "both")], Router(RouterConfig(), KVIndex()), BLOCK, SALT)
    assert "not served disaggregated" in aggregated.incompatibility("m", replace(p0.info))


class AbortedDuringSubmit(ScriptedWorker):
    """The client aborts while this worker is taking the request; like an engine, it ignores an abort of a
    request it does not have yet."""

    routed: RoutedEngine

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        self.routed.abort(request.request_id)
        super().submit(request, sink)

    def abort(self, request_id: RequestId) -> None:
        if request_id in self.sinks:
            self.aborted.append(request_id)


def test_an_abort_while_a_worker_takes_the_request_reaches_that_worker() -> None:
    worker = AbortedDuringSubmit("w0", "both")
    routed = RoutedEngine([worker], Router(RouterConfig(), KVIndex()), BLOCK, SALT)
    worker.routed = routed
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    routed.submit(request("r", 4), outputs.put)
    assert worker.aborted == ["r"]
    worker.answer("r", GenerationOutput(RequestId("r"), [], "", True, "abort", 4, 0, 0))
    assert [o.finish_reason for o in drain(outputs)] == ["abort"] and len(routed.flights) == 0
