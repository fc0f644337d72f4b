"""Disaggregated serving inside the engine: a prefill-only request hands its prompt's KV off after its first
token, a second engine resumes from the handoff; what the client would see (tokens and text, concatenated) is
what one engine produces alone. Real SmolLM2 engines, fp32 (and a batch-invariant bf16 pair, each busy with other
requests: tokens and logprobs bit for bit); the handoff moves through /dev/shm (kvbm/transfer.py).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading

import msgspec
import pytest
from conftest import LONG_TEXT, engine_config, greedy, run, watch_steps

from harness.waiting import wait_for
from kvbm.config import KVBMConfig
from kvbm.connector import KVBMConnector
from kvbm.transfer import SHM_DIR, KVTransfer, ShmTransport
from kvbm.transfer_params import (
    KVHandoff,
    KVReceived,
    RemoteDecode,
    decode_transfer_params,
    encode_transfer_params,
)
from kvbm.transfer_tcp import TcpTransport
from server.engine.api import GenerationOutput, GenerationRequest, RequestId, SamplingParams, structured_spec
from server.engine.llm_engine import LLMEngine
from server.engine.stream import iterate_outputs

HOST = socket.gethostname()


def prefill_only(request: GenerationRequest, host: str = HOST, **changes) -> GenerationRequest:
    """What the router sends a prefill worker: hand the KV off to `host` after the first token."""
    params = encode_transfer_params(RemoteDecode(host))
    return msgspec.structs.replace(request, kv_transfer_params=params, **changes)


def resumed(request: GenerationRequest, handoff: KVHandoff, **changes) -> GenerationRequest:
    """What the router sends the decode worker after the handoff."""
    return msgspec.structs.replace(request, kv_transfer_params=encode_transfer_params(handoff), **changes)


def handoff_of(output: GenerationOutput) -> KVHandoff | None:
    params = decode_transfer_params(output.kv_transfer_params)
    assert params is None or isinstance(params, KVHandoff)
    return params


def received_bytes(output: GenerationOutput) -> int:
    params = decode_transfer_params(output.kv_transfer_params)
    assert params is None or isinstance(params, KVReceived)
    return params.received_bytes if params is not None else 0


@pytest.fixture(scope="module")
def decoder() -> LLMEngine:
    with LLMEngine(engine_config()) as engine:
        yield engine


def disaggregated(
    prefill: LLMEngine, decode: LLMEngine, request: GenerationRequest
) -> tuple[list[int], str, list]:
    """Run `request` prefill-side on `prefill`, the rest on `decode`: (tokens, text, outputs as the client saw)."""
    first = run(prefill, prefill_only(request))
    shown = [first]
    if handoff_of(first) is None:  # the first token ended it
        return first.new_token_ids, first.new_text, shown
    assert first.finished and first.finish_reason is None
    rest = run(decode, resumed(request, handoff_of(first)))
    shown.append(rest)
    return first.new_token_ids + rest.new_token_ids, first.new_text + rest.new_text, shown


SPLIT = (
    0,
    3,
    8,
    9,
    12,
    13,
    16,
    19,
)  # of conftest.PROMPTS: short, digits, CJK, emoji, long, 2x long, chat, long chat


def test_greedy_output_is_the_same_split_across_two_engines(engine, decoder, prompt_ids):
    for i in SPLIT:
        ids = prompt_ids[i]
        alone = run(engine, greedy(ids, f"agg-{i}", max_tokens=24))
        tokens, text, shown = disaggregated(engine, decoder, greedy(ids, f"dis-{i}", max_tokens=24))
        assert (tokens, text) == (alone.new_token_ids, alone.new_text), f"prompt {i}"
        assert shown[-1].finish_reason == alone.finish_reason
        assert shown[-1].num_output_tokens == alone.num_output_tokens


def test_batch_invariant_engines_busy_with_others_split_a_request_as_one_engine_alone(prompt_ids):
    """bf16, both engines in the mode, each stepping three other requests meanwhile: a request prefilled on one and
    decoded on the other gets the tokens and logprobs one engine gives it alone (salted there, so that the split
    request finds none of its blocks cached)."""
    config = engine_config(dtype="bfloat16", batch_invariant=True)
    requests = [greedy(prompt_ids[i], f"bi-{i}", 16, ignore_eos=True, logprobs=1) for i in (9, 12, 19)]
    with LLMEngine(config) as prefill, LLMEngine(config) as decode:
        alone = [
            run(prefill, msgspec.structs.replace(r, request_id=RequestId(f"alone-{i}"), cache_salt="alone"))
            for i, r in enumerate(requests)
        ]
        steps = [watch_steps(prefill), watch_steps(decode)]
        busy = [
            (engine, greedy(prompt_ids[i], f"busy-{n}-{i}", 200, ignore_eos=True))
            for n, engine in enumerate((prefill, decode))
            for i in (4, 5, 14)
        ]
        for engine, other in busy:
            engine.submit(other, lambda output: None)
        split = []
        for request in requests:
            first = run(prefill, prefill_only(request))
            handoff = handoff_of(first)
            rest = list(iterate_outputs(decode, resumed(request, handoff), 120))
            # the decode engine read every block the prefill engine sent, and recomputed none
            assert received_bytes(rest[0]) == handoff.sent_bytes > 0
            split.append(first.logprobs + [entry for output in rest for entry in output.logprobs])
        for engine, other in busy:
            engine.abort(other.request_id)
    for request in requests:  # each part of it ran beside the other requests
        for engine_steps in steps:
            assert any(request.request_id in step and len(step) > 1 for step in engine_steps)
    assert split == [output.logprobs for output in alone]  # token ids, logprobs and top logprobs


def test_the_handoff_carries_the_prompt_blocks_and_is_removed_once_read(engine, decoder):
    ids = engine.encode("Report 7. " + LONG_TEXT * 3 + "Summary:")  # several 512-token chunks; not cached yet
    first = run(engine, greedy(ids, "blocks", max_tokens=8, ignore_eos=True))
    request = greedy(ids, "blocks-d", max_tokens=8, ignore_eos=True)
    out = run(engine, prefill_only(request))
    handoff = handoff_of(out)
    assert handoff.transport == "shm" and len(handoff.block_hashes) == len(ids) // 16
    assert handoff.sent_bytes == len(handoff.block_hashes) * handoff.block_bytes > 0
    assert (SHM_DIR / handoff.location).exists()
    outputs = list(iterate_outputs(decoder, resumed(request, handoff), 120))
    assert not (SHM_DIR / handoff.location).exists()
    assert received_bytes(outputs[0]) == handoff.sent_bytes  # every block read, none recomputed
    assert sum(received_bytes(o) for o in outputs[1:]) == 0  # reported once
    assert out.new_token_ids + [t for o in outputs for t in o.new_token_ids] == first.new_token_ids
    assert (
        outputs[-1].num_cached_tokens == out.num_cached_tokens
    )  # what the client was told at its first token


def test_a_lost_or_foreign_handoff_is_recomputed(engine, decoder):
    ids = engine.encode(LONG_TEXT + "In short:")
    alone = run(engine, greedy(ids, "lost-a", max_tokens=12))
    request = greedy(ids, "lost", max_tokens=12)
    out = run(engine, prefill_only(request))
    (SHM_DIR / handoff_of(out).location).unlink()  # gone (e.g. swept after its TTL)
    outputs = list(iterate_outputs(decoder, resumed(request, handoff_of(out)), 120))
    assert out.new_token_ids + [t for o in outputs for t in o.new_token_ids] == alone.new_token_ids
    assert sum(received_bytes(o) for o in outputs) == 0
    other_host = run(engine, prefill_only(request, "another-host", request_id=RequestId("lost-2")))
    assert handoff_of(other_host).transport == "none"  # no network transport in this process
    rest = run(decoder, resumed(request, handoff_of(other_host), request_id=RequestId("lost-3")))
    assert other_host.new_token_ids + rest.new_token_ids == alone.new_token_ids


def test_stop_strings_utf8_and_seeded_sampling_continue_as_one_engine(engine, decoder):
    ids = engine.encode("Emoji story: 🐶🐱🚀🌍 The dog and the cat flew to")
    cases = [
        SamplingParams(max_tokens=20, temperature=0.0, stop=[" the moon", "."]),
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=1234),
        SamplingParams(max_tokens=20, temperature=0.7, seed=7, stop=["🚀"], presence_penalty=0.5),
    ]
    for i, sampling in enumerate(cases):
        alone = run(engine, GenerationRequest(RequestId(f"s-a{i}"), ids, sampling))
        tokens, text, _ = disaggregated(
            engine, decoder, GenerationRequest(RequestId(f"s-d{i}"), ids, msgspec.structs.replace(sampling))
        )
        assert (tokens, text) == (alone.new_token_ids, alone.new_text), sampling


def test_a_first_token_that_ends_the_request_finishes_on_the_prefill_engine(engine):
    ids = engine.encode("The capital of France is")
    out = run(engine, prefill_only(greedy(ids, "one", max_tokens=1)))
    assert handoff_of(out) is None and out.finish_reason == "length" and len(out.new_token_ids) == 1


def test_a_decode_request_aborted_while_its_kv_is_fetched_ends_once(decoder, engine, monkeypatch):
    """The fetch is held until the abort has ended the request, so the abort lands while the KV is in flight,
    whatever the machine's speed; the fetched blocks then find the request gone and nothing more is sent."""
    ids = engine.encode(LONG_TEXT)
    request = greedy(ids, "ab", max_tokens=30)
    out = run(engine, prefill_only(request))
    fetching, release = threading.Event(), threading.Event()
    transfer = decoder.kv_transfer.transfer
    fetch = transfer.fetch

    def held_fetch(*args):
        fetching.set()
        assert release.wait(60)
        return fetch(*args)

    monkeypatch.setattr(transfer, "fetch", held_fetch)
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    decoder.submit(resumed(request, handoff_of(out)), outputs.put)
    assert fetching.wait(60)
    decoder.abort(request.request_id)
    final = outputs.get(timeout=60)  # ended by the abort while its fetch is still held
    release.set()
    assert final.finished and final.finish_reason == "abort" and final.new_token_ids == []
    with pytest.raises(queue.Empty):
        outputs.get(timeout=0.5)
    wait_for(decoder.is_idle, 30, what="the decoder idle")


def test_without_a_transport_the_blocks_go_through_the_kvbm_tiers(engine, tmp_path):
    """A decode worker no transport reaches (here: another host name, and no network transport) still gets the
    blocks when both workers have a KVBM tier in common: G2 here, G4 across nodes."""
    config = KVBMConfig(host_cache_gb=0.1, cache_id=f"disagg-{os.getpid()}", flush_budget_s=0)
    ids = engine.encode(LONG_TEXT + "Therefore")
    alone = run(engine, greedy(ids, "tiers-a", max_tokens=10))
    receiver = KVBMConnector(config, "d0", shm_dir=tmp_path)
    with (
        LLMEngine(engine_config(), KVBMConnector(config, "p0", shm_dir=tmp_path)) as prefill,
        LLMEngine(engine_config(), receiver) as decode,
    ):
        request = greedy(ids, "tiers", max_tokens=10)
        out = run(prefill, prefill_only(request, "another-host"))
        assert handoff_of(out).transport == "kvbm"
        rest = run(decode, resumed(request, handoff_of(out)))
    onboarded = receiver.metrics.registry.get_sample_value(
        "kvbm_onboard_blocks_total", {"model": "", "direction": "G2->G1"}
    )
    assert onboarded == len(ids) // 16  # every full prompt block, from G2
    assert out.new_token_ids + rest.new_token_ids == alone.new_token_ids
    assert rest.num_cached_tokens == 0  # as the prefill engine reported it (nothing was cached there)


def test_across_hosts_the_decode_engine_pulls_the_blocks_over_tcp(engine, decoder, monkeypatch):
    """Two host names on one machine: the handoff goes over the CURVE-authenticated TCP transport."""
    secret = b"disagg-test-secret-0123456789abcdef"
    sender = KVTransfer([ShmTransport(), TcpTransport(secret, "127.0.0.1")], host="prefill-host")
    receiver = KVTransfer([ShmTransport(), TcpTransport(secret, "127.0.0.1")], host="decode-host")
    monkeypatch.setattr(engine.kv_transfer, "transfer", sender)
    monkeypatch.setattr(decoder.kv_transfer, "transfer", receiver)
    try:
        ids = engine.encode("Report 9. " + LONG_TEXT * 2)
        alone = run(engine, greedy(ids, "tcp-a", max_tokens=12))
        request = greedy(ids, "tcp", max_tokens=12)
        out = run(engine, prefill_only(request, "decode-host"))
        handoff = handoff_of(out)
        assert handoff.transport == "tcp" and handoff.location.startswith("tcp://127.0.0.1:")
        outputs = list(iterate_outputs(decoder, resumed(request, handoff), 120))
        assert received_bytes(outputs[0]) == handoff.sent_bytes > 0
        assert out.new_token_ids + [t for o in outputs for t in o.new_token_ids] == alone.new_token_ids
    finally:
        sender.close()
        receiver.close()


def test_malformed_or_misplaced_transfer_params_are_refused_naming_the_field(engine):
    from server.engine.api import RequestError

    request = greedy(engine.encode("Hello"), "bad-params", max_tokens=4)
    handoff = KVHandoff("shm", "x", [], 64, [1, 2, 3, 4], 0)  # as many tokens as max_tokens: nothing left
    for raw in (b"\xc1", encode_transfer_params(KVReceived(1, 2)), encode_transfer_params(handoff)):
        with pytest.raises(RequestError) as refused:
            engine.submit(msgspec.structs.replace(request, kv_transfer_params=raw), lambda output: None)
        assert refused.value.field == "kv_transfer_params"
    assert engine.is_idle()


def test_a_grammar_and_logprobs_carry_over_the_handoff(engine, decoder):
    """The decode engine replays the prefill's first token into the request's grammar; the prompt's logprobs come
    with the prefill worker's output (the router asks the decode worker for none)."""
    ids = engine.apply_chat_template([{"role": "user", "content": "A user record as JSON."}])
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "admin": {"type": "boolean"}},
        "required": ["name", "admin"],
        "additionalProperties": False,
    }
    grammar = structured_spec("response_format", "json", schema)
    sampling = SamplingParams(
        max_tokens=40, temperature=0.0, logprobs=1, prompt_logprobs=1, structured_outputs=grammar
    )
    request = GenerationRequest(RequestId("json-split"), ids, sampling)
    alone = run(engine, msgspec.structs.replace(request, request_id=RequestId("json-alone")))
    first = run(engine, prefill_only(request))
    assert len(first.prompt_logprobs) == len(ids) and len(first.logprobs) == 1
    without_prompt = msgspec.structs.replace(sampling, prompt_logprobs=None)  # as the router sends it
    rest = run(decoder, resumed(request, handoff_of(first), sampling=without_prompt))
    assert rest.prompt_logprobs is None
    assert first.new_token_ids + rest.new_token_ids == alone.new_token_ids
    assert json.loads(first.new_text + rest.new_text) == json.loads(alone.new_text)
    assert [e.token_id for e in first.logprobs + rest.logprobs] == alone.new_token_ids
