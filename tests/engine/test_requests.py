"""Request validation, cancellation, failure isolation and the iterator helpers."""

from __future__ import annotations

import asyncio
import queue

import pytest
import torch
from conftest import collect_concurrently, engine_config, greedy, run, wait_until

from server.engine.api import EngineOverloaded, GenerationRequest, RequestError, RequestId, SamplingParams
from server.engine.llm_engine import LLMEngine
from server.engine.stream import aiterate_outputs, iterate_outputs


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"stop_token_ids": [10**7], "min_tokens": 2}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"best_of": 2}, "best_of"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_bad_sampling_fields_name_the_field(engine, fields, field):
    with pytest.raises(RequestError) as err:
        params = SamplingParams.from_dict(fields, max_tokens_limit=engine.config.max_tokens_limit)
        engine.submit(GenerationRequest(RequestId("bad"), [1, 2, 3], params), lambda output: None)
    assert err.value.field == field


def test_bad_prompts_name_the_field_and_engine_keeps_serving(engine, prompt_ids):
    sink = lambda output: None  # noqa: E731
    with pytest.raises(RequestError) as empty:
        engine.submit(GenerationRequest(RequestId("empty"), [], SamplingParams()), sink)
    assert empty.value.field == "prompt"
    too_long = [42] * engine.max_model_len
    with pytest.raises(RequestError) as long:
        engine.submit(GenerationRequest(RequestId("long"), too_long, SamplingParams()), sink)
    assert long.value.field == "prompt"
    with pytest.raises(RequestError) as over_limit:
        engine.submit(greedy([1, 2], "over", max_tokens=engine.config.max_tokens_limit + 1), sink)
    assert over_limit.value.field == "max_tokens"
    with pytest.raises(RequestError) as vocab:
        engine.submit(GenerationRequest(RequestId("vocab"), [10**7], SamplingParams()), sink)
    assert vocab.value.field == "prompt"
    assert run(engine, greedy(prompt_ids[1], "after-bad")).finish_reason in ("stop", "length")


def test_duplicate_request_id_is_refused(engine, prompt_ids):
    outputs = iterate_outputs(engine, greedy(prompt_ids[13], "dup", max_tokens=64, ignore_eos=True))
    next(outputs)
    with pytest.raises(RequestError) as err:
        engine.submit(greedy([1, 2], "dup"), lambda output: None)
    assert err.value.field == "request_id"
    outputs.close()  # aborts


def test_abort_frees_blocks_at_once(engine, prompt_ids):
    wait_until(engine.is_idle)
    baseline = engine.stats().num_free_blocks
    outputs = iterate_outputs(engine, greedy(prompt_ids[13], "abort-me", max_tokens=200, ignore_eos=True))
    first = next(outputs)
    assert not first.finished
    assert engine.stats().num_free_blocks < baseline
    engine.abort(RequestId("abort-me"))
    last = list(outputs)[-1]
    assert last.finished and last.finish_reason == "abort"
    assert last.num_output_tokens < 200
    wait_until(engine.is_idle)
    assert engine.stats().num_free_blocks == baseline == engine.stats().num_blocks


def test_leaving_the_iterator_aborts(engine, prompt_ids):
    for output in iterate_outputs(engine, greedy(prompt_ids[2], "leave", max_tokens=200, ignore_eos=True)):
        if output.num_output_tokens >= 2:
            break
    wait_until(engine.is_idle)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_step_failure_fails_its_requests_and_engine_keeps_serving(engine, prompt_ids, monkeypatch, caplog):
    real_run = engine.runner.run
    calls = {"n": 0}

    def failing_run(chunks):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real_run(chunks)

    monkeypatch.setattr(engine.runner, "run", failing_run)
    failed = run(engine, greedy(prompt_ids[1], "boom"))
    assert failed.finish_reason == "error"
    assert failed.error == "internal engine error (request boom); see the server log"  # the text: in the log
    assert "request boom failed: RuntimeError: injected" in caplog.text
    ok = run(engine, greedy(prompt_ids[1], "after-boom"))
    assert ok.finish_reason in ("stop", "length") and ok.num_output_tokens > 0
    wait_until(engine.is_idle)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def _inject_fault(engine, monkeypatch, where: str, bad: str) -> None:
    """Make one stage of the engine step raise whenever request `bad` takes part in it."""

    def poisoned(real, seqs_of):
        def call(*args, **kwargs):
            if any(seq.request_id == bad for seq in seqs_of(*args, **kwargs)):
                raise ValueError(f"injected {where} fault")
            return real(*args, **kwargs)

        return call

    if where == "forward":
        monkeypatch.setattr(
            engine.runner, "run", poisoned(engine.runner.run, lambda chunks: [c.seq for c in chunks])
        )
    elif where == "sampler":
        core = engine.core
        monkeypatch.setattr(core, "sampler", poisoned(core.sampler, lambda logits, seqs: seqs))
    elif where == "admission":  # a request's own scheduling work (its handoff read, at admission)
        manager = engine.block_manager
        monkeypatch.setattr(
            manager, "receive", poisoned(manager.receive, lambda seq, num_hits, max_blocks: [seq])
        )
    elif where == "blocks":
        manager = engine.block_manager
        monkeypatch.setattr(
            manager, "register_full_blocks", poisoned(manager.register_full_blocks, lambda s: [s])
        )
    else:
        outputs = engine.core.outputs
        monkeypatch.setattr(outputs, "check_stop", poisoned(outputs.check_stop, lambda seq, token: [seq]))


@pytest.mark.parametrize("where", ["admission", "forward", "sampler", "blocks", "stop_check"])
def test_a_fault_in_one_sequence_fails_that_request_alone(engine, prompt_ids, monkeypatch, caplog, where):
    """Fault injection: the poisoned request ends with finish_reason "error" (its client sees its id, the log the
    reason); the requests batched with it finish normally with the tokens they produce without the fault."""
    requests = lambda tag: [greedy(prompt_ids[i], f"{tag}-{i}", max_tokens=6) for i in range(3)]  # noqa: E731
    reference = collect_concurrently(engine, requests("ref"))
    _inject_fault(engine, monkeypatch, where, bad="iso-1")
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    for request in requests("iso"):
        engine.submit(request, outputs.put)
    tokens: dict[str, list[int]] = {f"iso-{i}": [] for i in range(3)}
    last = {}
    while len(last) < 3:
        output = outputs.get(timeout=120)
        tokens[output.request_id].extend(output.new_token_ids)
        if output.finished:
            last[output.request_id] = output
    assert last["iso-1"].finish_reason == "error"
    assert last["iso-1"].error == "internal engine error (request iso-1); see the server log"
    assert f"request iso-1 failed: ValueError: injected {where} fault" in caplog.text
    for i in (0, 2):
        assert last[f"iso-{i}"].finish_reason in ("stop", "length"), last[f"iso-{i}"].error
        assert tokens[f"iso-{i}"] == reference[f"ref-{i}"]
    assert engine.healthy
    wait_until(engine.is_idle)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_failing_sink_does_not_stop_the_engine(engine, prompt_ids):
    def bad_sink(output):
        raise OSError("client went away")

    engine.submit(greedy(prompt_ids[0], "bad-sink"), bad_sink)
    assert run(engine, greedy(prompt_ids[0], "good-sink")).num_output_tokens > 0
    wait_until(engine.is_idle)


def test_async_iterator(engine, prompt_ids):
    async def consume():
        tokens, last = [], None
        async for output in aiterate_outputs(
            engine, greedy(prompt_ids[1], "async", max_tokens=8, ignore_eos=True)
        ):
            tokens.extend(output.new_token_ids)
            last = output
        return tokens, last

    tokens, last = asyncio.run(consume())
    assert len(tokens) == 8 and last.finished and last.finish_reason == "length"


def test_many_concurrent_requests_beyond_the_concurrency_limit(prompt_ids):
    small = LLMEngine(engine_config(num_kv_blocks=128, max_concurrent_requests=3))
    try:
        requests = [greedy(prompt_ids[i % 8], f"q-{i}", max_tokens=4, ignore_eos=True) for i in range(12)]
        tokens = collect_concurrently(small, requests)
        assert all(len(t) == 4 for t in tokens.values())
        assert small.stats().num_running == 0
    finally:
        small.close()


def test_bfloat16_engine_and_byte_sized_pool(prompt_ids, engine):
    """bf16 weights and KV (pool sized in bytes): greedy text starts like the fp32 engine's."""
    with LLMEngine(engine_config(dtype="bfloat16", num_kv_blocks=None, kv_cache_bytes=64 << 20)) as bf16:
        assert bf16.runner.kv_cache.dtype == torch.bfloat16
        assert bf16.stats().num_blocks == (64 << 20) // bf16.layout.block_bytes
        assert "bfloat16" in bf16.layout.fingerprint and bf16.layout.fingerprint != engine.layout.fingerprint
        # the long prompt: fp32's top token leads its runner-up by 1.3-2.0 logits at each of the first three
        # steps, more than bf16 rounding moves them (prompt 16 leads by 0.08 at its first: a coin toss in bf16)
        ids = prompt_ids[13]
        ours = run(bf16, greedy(ids, "bf16", max_tokens=6))
        reference = run(engine, greedy(ids, "fp32", max_tokens=6))
        assert ours.new_token_ids[:3] == reference.new_token_ids[:3]


def test_a_full_wait_queue_refuses_new_requests(prompt_ids):
    """max_queued_requests bounds the sequences waiting for a slot: one more is refused (not queued), and the
    engine takes requests again once the queue drains."""
    small = LLMEngine(engine_config(num_kv_blocks=128, max_concurrent_requests=1, max_queued_requests=2))
    try:
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        small.submit(greedy(prompt_ids[0], "running", max_tokens=250, ignore_eos=True), outputs.put)
        wait_until(lambda: small.stats().num_running == 1)
        for i in range(2):
            small.submit(greedy(prompt_ids[1], f"queued-{i}", max_tokens=2), outputs.put)
        with pytest.raises(EngineOverloaded, match="max_queued_requests"):
            small.submit(greedy(prompt_ids[1], "refused", max_tokens=2), outputs.put)
        assert small.num_rejected == 1
        small.abort(RequestId("running"))
        wait_until(small.is_idle)
        assert run(small, greedy(prompt_ids[1], "after", max_tokens=2)).num_output_tokens == 2
    finally:
        small.close()
