"""End to end with the real engine (SmolLM2, fp32, CPU): greedy output is identical whether a prefix is prefilled
or onboarded from G2/G3, with a G1 pool so small that blocks are evicted to G2, spilled to G3 and come back."""

from __future__ import annotations

from pathlib import Path

import obstore
import pytest
from kvbm_testing import BLOCK_KEY
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvbm.agent import build_connector
from kvbm.block_hash import block_hashes
from kvbm.config import GIB, KVBMConfig
from kvbm.index import KVIndex
from kvbm.object_pool import open_store
from server import tracing
from server.engine.api import GenerationRequest, RequestId, SamplingParams
from server.engine.config import EngineConfig
from server.engine.llm_engine import LLMEngine
from server.engine.stream import generate

pytestmark = pytest.mark.slow
MODEL_CACHE = Path(__file__).resolve().parents[2] / ".strata-cache" / "models"
BLOCK_BYTES = 737_280  # SmolLM2-135M fp32, 16 tokens
TOPICS = ("the printing press", "the steam engine", "the telegraph", "penicillin")


def document(topic: str) -> str:
    sentences = [
        f"Paragraph {i} is about {topic} and how it changed daily life in town number {i}." for i in range(20)
    ]
    return " ".join(sentences) + " In one sentence, the main effect was"


def engine(num_kv_blocks: int, connector=None) -> LLMEngine:
    config = EngineConfig(
        cache_dir=str(MODEL_CACHE), dtype="float32", device="cpu", num_kv_blocks=num_kv_blocks, max_model_len=1024,
        max_num_batched_tokens=512, max_tokens_limit=64, num_threads=2, max_concurrent_requests=1,
    )  # fmt: skip
    return LLMEngine(config, connector)


def greedy(engine: LLMEngine, prompt: list[int], request_id: str, trace_context: str | None = None):
    sampling = SamplingParams(max_tokens=8, temperature=0.0)
    request = GenerationRequest(RequestId(request_id), prompt, sampling, trace_context=trace_context)
    return generate(engine, request, timeout=300)


def onboarded_per_tier(connector) -> dict[str, float]:
    registry = connector.metrics.registry
    return {
        tier: registry.get_sample_value(
            "kvbm_onboard_blocks_total", {"model": connector.metrics.model, "direction": f"{tier}->G1"}
        )
        or 0
        for tier in ("G2", "G3", "G4", "G5")
    }


def test_greedy_identical_with_onboarded_prefixes(cache_id: str, tmp_path: Path, redis_url: str) -> None:
    with engine(400) as reference:
        prompts = [reference.encode(document(topic)) for topic in TOPICS]
        prompts.append(prompts[0][:-8] + reference.encode(" To summarise, the inventors"))
        expected = [greedy(reference, ids, f"ref-{i}").new_token_ids for i, ids in enumerate(prompts)]
    assert all(len(ids) > 200 for ids in prompts)
    config = KVBMConfig(
        cache_id=cache_id, host_cache_gb=24 * BLOCK_BYTES / GIB, disk_cache_gb=256 * BLOCK_BYTES / GIB,
        disk_path=tmp_path, redis_url=redis_url, write_through=True, block_key=BLOCK_KEY,
    )  # fmt: skip
    index = KVIndex()
    connector = build_connector(config, "engine-worker", index=index)
    with engine(40, connector) as tiny:  # 40 blocks: one prompt and a half fit in G1
        cold = [greedy(tiny, ids, f"cold-{i}") for i, ids in enumerate(prompts)]
        # newest first: the latest evictions are still in G2, the older ones were spilled to G3
        warm = [greedy(tiny, ids, f"warm-{i}") for i, ids in reversed(list(enumerate(prompts)))][::-1]
        onboarded = onboarded_per_tier(connector)
        report = index.query(block_hashes(prompts[0], 16, tiny.salt))
    connector.close()
    assert [out.new_token_ids for out in cold] == expected
    assert [out.new_token_ids for out in warm] == expected
    assert all(out.num_cached_tokens >= 160 for out in warm[:4]), [out.num_cached_tokens for out in warm]
    assert onboarded["G2"] > 0 and onboarded["G3"] > 0, onboarded
    assert report.workers["engine-worker"].g3 == report.num_blocks  # the index saw every tier move
    assert report.g4 == report.num_blocks  # written through


def test_other_node_onboards_from_g4(cache_id: str, tmp_path: Path, redis_url: str) -> None:
    """A second engine with an empty G1 and only G4 reuses what the first one offloaded to Redis. Traced: the
    evicting request's offload and the reader's G4 read are spans of theirs."""
    config = KVBMConfig(
        cache_id=cache_id, host_cache_gb=0, redis_url=redis_url, write_through=True, block_key=BLOCK_KEY
    )
    spans = InMemorySpanExporter()
    tracing.configure(None, 1.0, "node", processor=SimpleSpanProcessor(spans))
    try:
        writer = build_connector(config, "node-a", index=KVIndex())
        with engine(40, writer) as first:
            prompt = first.encode(document(TOPICS[0]))
            expected = greedy(first, prompt, "a").new_token_ids
            for i, topic in enumerate(
                TOPICS[1:3]
            ):  # G1 evicts (so offloads) chains tail first: two more prompts
                greedy(first, first.encode(document(topic)), f"evict-{topic}", f"00-{'ef' * 16}-{i:016x}-01")
        writer.close()
        reader = build_connector(config, "node-b", index=KVIndex())
        with engine(40, reader) as second:
            output = greedy(second, prompt, "b", trace_context=f"00-{'ab' * 16}-{'cd' * 8}-01")
    finally:
        tracing.shutdown()
    reader.close()
    assert output.new_token_ids == expected
    assert output.num_cached_tokens >= 160 and onboarded_per_tier(reader)["G4"] > 0
    finished = spans.get_finished_spans()
    requests = {
        span.attributes["strata.request_id"]: span
        for span in finished
        if span.name == "strata.engine.request"
    }
    (read,) = [span for span in finished if span.name == "strata.kvbm.onboard"]
    assert read.attributes["strata.kvbm.tier"] == "G4"
    assert read.attributes["strata.kvbm.blocks"] == onboarded_per_tier(reader)["G4"]
    assert read.attributes["strata.kvbm.bytes"] == read.attributes["strata.kvbm.blocks"] * BLOCK_BYTES
    assert read.parent.span_id == requests["b"].context.span_id
    assert requests["b"].attributes["strata.usage.cached_tokens"] == output.num_cached_tokens
    offloads = [span for span in finished if span.name == "strata.kvbm.offload"]
    assert offloads and sum(span.attributes["strata.kvbm.blocks"] for span in offloads) > 0
    evicting = {requests[f"evict-{topic}"].context.span_id for topic in TOPICS[1:3]}
    assert {span.parent.span_id for span in offloads} <= evicting


def test_fresh_engine_onboards_from_the_bucket(cache_id: str, object_url: str, monkeypatch) -> None:
    """G5 with nothing else shared: the first engine's blocks reach the bucket as G1 evicts them (through G2);
    a second engine with a fresh G2, no G3 and no Redis answers from them with the same greedy tokens. With
    every other object tampered, or credentials the store refuses, the answer is the same again."""
    first_config = KVBMConfig(
        cache_id=cache_id, host_cache_gb=8 * BLOCK_BYTES / GIB, object_url=object_url, block_key=BLOCK_KEY
    )
    writer = build_connector(first_config, "server-a")
    with engine(40, writer) as first:
        prompt = first.encode(document(TOPICS[0]))
        expected = greedy(first, prompt, "a").new_token_ids
        for topic in TOPICS[1:3]:  # push the first prompt's blocks out of G1 (and through the small G2)
            greedy(first, first.encode(document(topic)), f"evict-{topic}")
    writer.close()  # drains the uploads
    fresh = KVBMConfig(cache_id=cache_id + "-b", host_cache_gb=0, object_url=object_url, block_key=BLOCK_KEY)
    reader = build_connector(fresh, "server-b")
    with engine(40, reader) as second:
        output = greedy(second, prompt, "b")
    reader.close()
    assert output.new_token_ids == expected
    assert output.num_cached_tokens >= 160 and onboarded_per_tier(reader)["G5"] > 0

    store = open_store(object_url, 2.0)  # someone with write access to the bucket but not the secret
    names = [e["path"] for chunk in obstore.list(store) for e in chunk if not e["path"].endswith(".txt")]
    for name in names[::2]:
        value = bytearray(obstore.get(store, name).bytes())
        value[100] ^= 0xFF
        obstore.put(store, name, bytes(value))
    checker = build_connector(fresh, "server-d")
    with engine(40, checker) as fourth:
        output = greedy(fourth, prompt, "d")
    checker.close()
    assert output.new_token_ids == expected
    failures = checker.metrics.registry.get_sample_value(
        "kvbm_checksum_failures_total", {"model": checker.metrics.model, "tier": "G5"}
    )
    assert failures and failures >= 1

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    refused = build_connector(fresh, "server-c")
    with engine(40, refused) as third:
        output = greedy(third, prompt, "c")
    refused.close()
    assert output.new_token_ids == expected and output.num_cached_tokens == 0
