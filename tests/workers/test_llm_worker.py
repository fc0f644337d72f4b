"""A real SmolLM2 engine in a worker process: calibrated at start without a trace, its KVBM events reach the
router's index, its prefix cache hits."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest

from kvbm.block_hash import BlockHash, block_hashes
from kvbm.index import KVIndex
from server.engine.api import GenerationOutput, GenerationRequest, RequestId, SamplingParams
from server.engine.config import EngineConfig
from server.workers.protocol import WorkerId
from server.workers.remote import RemoteEngine
from server.workers.worker import WorkerSpec, build_llm_engine

MODEL_CACHE = Path(__file__).resolve().parents[2] / ".strata-cache" / "models"  # shared with tests/engine


def _finish(outputs: queue.SimpleQueue[GenerationOutput]) -> GenerationOutput:
    while not (output := outputs.get(timeout=120)).finished:
        pass
    return output


@pytest.mark.slow
def test_llm_worker_reports_its_blocks_and_reuses_them() -> None:
    config = EngineConfig(
        cache_dir=str(MODEL_CACHE),
        dtype="float32",
        device="cpu",
        num_kv_blocks=100,
        max_model_len=1024,
        max_tokens_limit=16,
        num_threads=1,
        model_name="smollm2",
    )
    index = KVIndex()
    worker = RemoteEngine.spawn(
        WorkerId("w0"), WorkerSpec(build_llm_engine, (config, None), forward_events=True), event_sink=index
    )
    try:
        assert (
            worker.info.speeds.prefill_tok_s > 0 and worker.info.speeds.decode_tok_s > 0
        )  # calibrated at start
        assert worker.info.hardware.kv_capacity_blocks == 100
        assert worker.info.hardware.kv_capacity_bytes == 100 * 16 * 46_080
        assert len(index) == 0  # calibration left no block in the cache or the index
        prompt = worker.encode("The history of the printing press begins in the fifteenth century. " * 4)
        outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
        for name in ("first", "second"):
            worker.submit(
                GenerationRequest(RequestId(name), prompt, SamplingParams(max_tokens=2, temperature=0)),
                outputs.put,
            )
            last = _finish(outputs)
        full_blocks = len(prompt) // worker.info.block_size
        assert last.num_cached_tokens >= (full_blocks - 1) * worker.info.block_size  # the last may recompute
        report = index.query(block_hashes(prompt, worker.info.block_size, BlockHash(worker.info.salt)))
        assert report.workers["w0"].g1 == full_blocks
    finally:
        worker.close()
