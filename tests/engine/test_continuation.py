"""`continuation`: the one place a request is resumed after some of its tokens (router migration, a decode engine
continuing a prefill worker's handoff)."""

from __future__ import annotations

import pytest

from kvbm.transfer_params import KVHandoff, RemoteDecode, encode_transfer_params
from server.engine.api import GenerationRequest, RequestId, SamplingParams, StructuredOutput, continuation


def _request(max_tokens: int = 10, min_tokens: int = 4) -> GenerationRequest:
    sampling = SamplingParams(
        max_tokens=max_tokens, min_tokens=min_tokens, temperature=0.7, seed=11, stop=["\n"]
    )
    return GenerationRequest(RequestId("r"), [1, 2, 3], sampling, cache_salt="tenant-a")


@pytest.mark.parametrize("done", [0, 1, 3, 4, 5, 9])
def test_the_continuation_asks_for_what_is_left(done: int) -> None:
    request = _request()
    generated = list(range(100, 100 + done))
    rest = continuation(request, generated)
    assert rest.prompt_token_ids == [1, 2, 3, *generated]
    assert done + rest.sampling.max_tokens == request.sampling.max_tokens
    assert rest.sampling.min_tokens == max(0, 4 - done)
    assert (rest.request_id, rest.cache_salt) == (request.request_id, request.cache_salt)
    assert (rest.sampling.seed, rest.sampling.stop, rest.sampling.temperature) == (11, ["\n"], 0.7)


def test_the_request_is_left_as_it_was() -> None:
    request = _request()
    continuation(request, [7, 8])
    assert request.prompt_token_ids == [1, 2, 3]
    assert (request.sampling.max_tokens, request.sampling.min_tokens) == (10, 4)


def test_the_router_fields_are_dropped() -> None:
    for params in (RemoteDecode("h"), KVHandoff("shm", "somewhere", [1], 64, [7], 0)):
        raw = encode_transfer_params(params)
        request = GenerationRequest(
            RequestId("p"), [1, 2], SamplingParams(max_tokens=4), kv_transfer_params=raw
        )
        assert continuation(request, [7]).kv_transfer_params is None


@pytest.mark.parametrize("done", [10, 11])
def test_nothing_left_to_generate_is_refused(done: int) -> None:
    with pytest.raises(ValueError, match="none is left"):
        continuation(_request(), [5] * done)


def test_prompt_logprobs_stay_until_tokens_are_out_and_the_grammar_counts_them() -> None:
    grammar = StructuredOutput("json", '{"type": "object"}', "response_format")
    sampling = SamplingParams(max_tokens=8, prompt_logprobs=2, structured_outputs=grammar)
    request = GenerationRequest(RequestId("r"), [1, 2, 3], sampling)
    untouched = continuation(request, [])
    assert (
        untouched.sampling.prompt_logprobs == 2 and untouched.sampling.structured_outputs.num_generated == 0
    )
    rest = continuation(continuation(request, [7, 8]), [9])
    assert rest.sampling.prompt_logprobs is None  # sent with the first output
    assert rest.sampling.structured_outputs.num_generated == 3 and rest.prompt_token_ids[-3:] == [7, 8, 9]
