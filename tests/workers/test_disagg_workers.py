"""Disaggregated serving with real SmolLM2 worker processes: two prefill workers and one decode worker behind a
RoutedEngine with the conditional rule, against one in-process engine (the aggregated reference, same config).

Greedy outputs, streamed and concurrent, must be identical whether a prompt is prefilled remotely (KV handed
through /dev/shm), locally on the decode worker, after a prefill worker died mid-request, or with every prefill
worker gone (aggregated fallback); the rule goes back to remote prefill when a prefill worker joins.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import threading
from pathlib import Path

import pytest

from harness.waiting import wait_for
from kvbm.block_hash import BlockHash
from kvbm.index import KVIndex
from server.engine.api import GenerationOutput, GenerationRequest, RequestId, SamplingParams
from server.engine.config import EngineConfig
from server.engine.llm_engine import LLMEngine
from server.engine.stream import generate
from server.router.config import RouterConfig
from server.router.disagg import DisaggConfig, DisaggRule
from server.router.routed import RoutedEngine
from server.router.router import Router
from server.router.state import RequestState
from server.workers.protocol import WorkerId
from server.workers.remote import RemoteEngine, spawn_workers
from server.workers.worker import WorkerSpec, build_llm_engine

pytestmark = pytest.mark.slow

MODEL_CACHE = Path(__file__).resolve().parents[2] / ".strata-cache" / "models"  # shared with tests/engine
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined a "
    "screw press with movable metal type, oil-based ink and a mould for casting letters. "
)
LOCAL_LIMIT = 96  # tokens: longer uncached parts are prefilled remotely


def engine_config() -> EngineConfig:
    return EngineConfig(
        cache_dir=str(MODEL_CACHE), dtype="float32", device="cpu", num_kv_blocks=300, max_model_len=2048,
        max_num_batched_tokens=256, max_tokens_limit=64, num_threads=1, model_name="smollm2",
    )  # fmt: skip


SPEC = WorkerSpec(build_llm_engine, (engine_config(), None), forward_events=True)


@pytest.fixture(scope="module")
def cluster():
    index = KVIndex()
    ids = [WorkerId("p0"), WorkerId("p1"), WorkerId("d0")]
    workers = spawn_workers(ids, SPEC, ["prefill", "prefill", "decode"], event_sink=index)
    router, prefill_router = Router(RouterConfig(), index), Router(RouterConfig(), index)
    rule = DisaggRule(DisaggConfig(max_local_prefill_length=LOCAL_LIMIT, max_prefill_queue_size=8))
    info = workers[0].info
    routed = RoutedEngine(
        workers, router, info.block_size, BlockHash(info.salt), prefill_router=prefill_router, disagg=rule
    )
    reference = LLMEngine(engine_config())
    yield routed, reference, index
    routed.close()
    reference.close()


def greedy(ids: list[int], request_id: str, max_tokens: int = 24) -> GenerationRequest:
    return GenerationRequest(
        RequestId(request_id), ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)
    )


def stream(routed: RoutedEngine, request: GenerationRequest) -> tuple[list[int], str, list[GenerationOutput]]:
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    routed.submit(request, outputs.put)
    seen = [outputs.get(timeout=180)]
    while not seen[-1].finished:
        seen.append(outputs.get(timeout=180))
    assert seen[-1].finish_reason in ("stop", "length"), seen[-1]
    return [t for o in seen for t in o.new_token_ids], "".join(o.new_text for o in seen), seen


def prefills(routed: RoutedEngine) -> dict[tuple[str, str], float]:
    registry = routed.router.metrics.registry
    return {
        (sample.labels["where"], sample.labels["reason"]): sample.value
        for metric in registry.collect()
        if metric.name == "strata_disagg_prefills"
        for sample in metric.samples
        if sample.name.endswith("_total")
    }


def expected(reference: LLMEngine, ids: list[int], max_tokens: int = 24) -> tuple[list[int], str]:
    out = generate(reference, greedy(ids, f"ref-{len(ids)}-{hash(tuple(ids))}", max_tokens), timeout=180)
    return out.new_token_ids, out.new_text


def test_remote_and_local_prefills_stream_the_same_tokens_as_one_engine(cluster):
    routed, reference, _ = cluster
    long_a = routed.encode(TEXT * 6 + "In one sentence:")  # ~300 tokens: remote
    long_b = routed.encode("Summarise: " + TEXT * 4)
    short = routed.encode("The capital of France is")  # local
    conversation = long_a + routed.encode(" The press changed Europe. Why?")  # long_a's prefix cached after
    before = prefills(routed)
    results: dict[str, tuple] = {}

    def run(name: str, ids: list[int]) -> None:
        results[name] = stream(routed, greedy(ids, name))

    threads = [threading.Thread(target=run, args=(n, ids)) for n, ids in
               (("a", long_a), ("b", long_b), ("s", short))]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    run("c", conversation)  # long, but mostly cached on the decode worker now: local
    for name, ids in (("a", long_a), ("b", long_b), ("s", short), ("c", conversation)):
        tokens, text, seen = results[name]
        assert (tokens, text) == expected(reference, ids), name
        assert seen[-1].num_prompt_tokens == len(ids) and seen[-1].num_output_tokens == len(tokens)
    after = prefills(routed)
    grown = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    assert grown.get(("remote", "long_prompt")) == 2, grown
    assert grown.get(("local", "short_prompt")) == 2, grown  # the short prompt, and the cached conversation
    registry = routed.router.metrics.registry
    assert registry.get_sample_value("strata_disagg_kv_transfer_bytes_total", {"model": "smollm2",
                                                                               "transport": "shm"}) > 0  # fmt: skip
    assert registry.get_sample_value("strata_disagg_prefill_queue", {"model": "smollm2"}) == 0
    assert registry.get_sample_value("strata_workers", {"model": "smollm2", "role": "prefill"}) == 2


def test_a_long_prompt_whose_prefill_worker_dies_is_prefilled_again(cluster):
    routed, reference, _ = cluster
    ids = routed.encode("Explain: " + TEXT * 12)  # ~600 tokens: seconds of prefill on one thread
    before = prefills(routed)
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    routed.submit(greedy(ids, "dies"), outputs.put)
    flight = routed.flights.get(RequestId("dies"))
    assert flight.state is RequestState.PREFILLING_REMOTE
    victim = routed.membership.get(flight.worker_id)
    os.kill(victim.info.pid, signal.SIGKILL)
    seen = [outputs.get(timeout=180)]
    while not seen[-1].finished:
        seen.append(outputs.get(timeout=180))
    tokens = [t for o in seen for t in o.new_token_ids]
    assert (tokens, "".join(o.new_text for o in seen)) == expected(reference, ids)
    assert not victim.alive
    remote = ("remote", "long_prompt")
    assert prefills(routed)[remote] == before[remote] + 2  # the first try, then the other prefill worker


def test_without_prefill_workers_decode_prefills_locally_then_remote_again_when_one_joins(cluster):
    routed, reference, index = cluster
    for worker in list(routed.membership.all()):
        if worker.info.role == "prefill" and worker.alive:
            os.kill(worker.info.pid, signal.SIGKILL)
    ids = routed.encode("Describe: " + TEXT * 5)
    before = prefills(routed)
    wait_for(
        lambda: not any(w.alive for w in routed.membership.all() if w.info.role == "prefill"),
        30,
        0.05,
        what="the prefill workers' deaths noticed",
    )
    tokens, text, _ = stream(routed, greedy(ids, "fallback"))
    assert (tokens, text) == expected(reference, ids)
    assert (
        prefills(routed).get(("local", "no_prefill_worker"), 0)
        == before.get(("local", "no_prefill_worker"), 0) + 1
    )
    joined = RemoteEngine.spawn(WorkerId("p2"), dataclasses.replace(SPEC, role="prefill"), event_sink=index)
    routed.add_worker(joined)
    again = routed.encode("Describe again: " + TEXT * 5)
    tokens, text, _ = stream(routed, greedy(again, "back"))
    assert (tokens, text) == expected(reference, again)
    assert prefills(routed).get(("remote", "long_prompt"), 0) >= before.get(("remote", "long_prompt"), 0) + 1
