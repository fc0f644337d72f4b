"""Logprobs, prompt logprobs, min_p, logit_bias and repetition_penalty in the engine's sampler, against
transformers' fp32 log-softmax of the same weights."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import LONG_TEXT, collect_concurrently, greedy, run

from server.engine.api import GenerationRequest, RequestId, SamplingParams

TOLERANCE = 0.05  # nats: the engine's fp32 kernels against transformers' fp32 ops


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: row p is the log-softmax of the logits at position p (predicting token p + 1)."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def sampled(ids: list[int], request_id: str, **fields) -> GenerationRequest:
    params = SamplingParams.from_dict({"max_tokens": 8, "ignore_eos": True, **fields}, max_tokens_limit=256)
    return GenerationRequest(RequestId(request_id), list(ids), params)


def check_entry(entry, reference: torch.Tensor, token_id: int, count: int) -> None:
    """`entry` (TokenLogprobs) matches `reference` (one row of hf_logprobs) for `token_id` and its top `count`."""
    assert entry.token_id == token_id
    assert abs(entry.logprob - reference[token_id].item()) < TOLERANCE
    assert len(entry.top_token_ids) == len(entry.top_logprobs) == len(entry.top_tokens) == count
    expected = reference.topk(count).values.tolist()
    assert all(abs(a - b) < TOLERANCE for a, b in zip(entry.top_logprobs, expected, strict=True))
    for tid, value in zip(entry.top_token_ids, entry.top_logprobs, strict=True):
        assert abs(reference[tid].item() - value) < TOLERANCE
    assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)


@pytest.mark.parametrize("index", [1, 9, 16])  # plain text, emoji (multi-byte tokens), a chat template
def test_greedy_logprobs_equal_transformers(engine, hf_model, prompt_ids, index):
    ids = prompt_ids[index]
    output = run(engine, greedy(ids, f"lp-{index}", max_tokens=8, ignore_eos=True, logprobs=5))
    assert len(output.logprobs) == len(output.new_token_ids) == 8
    reference = hf_logprobs(hf_model, ids + output.new_token_ids)
    for i, (entry, token_id) in enumerate(zip(output.logprobs, output.new_token_ids, strict=True)):
        check_entry(entry, reference[len(ids) - 1 + i], token_id, 5)
        assert entry.top_token_ids[0] == token_id  # greedy: the chosen token is the most likely
        assert entry.token == engine.tokenizer.decode([token_id], skip_special_tokens=False)


def test_logprobs_are_of_the_raw_logits_not_the_sampling_distribution(engine, hf_model, prompt_ids):
    """Temperature and penalties shape the draw, not the reported logprobs (vLLM's default logprobs_mode)."""
    ids = prompt_ids[4]
    request = sampled(ids, "raw", temperature=1.7, frequency_penalty=1.5, seed=11, logprobs=0)
    output = run(engine, request)
    reference = hf_logprobs(hf_model, ids + output.new_token_ids)
    for i, (entry, token_id) in enumerate(zip(output.logprobs, output.new_token_ids, strict=True)):
        check_entry(entry, reference[len(ids) - 1 + i], token_id, 0)


def test_prompt_logprobs_equal_transformers_across_chunks_and_cache_hits(engine, hf_model):
    """A prompt longer than one prefill chunk (512 tokens), sent twice: the second is a prefix-cache hit for
    plain requests, but prompt logprobs need every position's logits, so they are computed again and agree."""
    ids = engine.encode(LONG_TEXT * 3 + "In short:")
    assert len(ids) > 512
    reference = hf_logprobs(hf_model, ids)
    warm = run(engine, greedy(ids, "warm", max_tokens=1))  # fills the prefix cache
    assert warm.prompt_logprobs is None and warm.logprobs is None
    for attempt in ("first", "again"):
        output = run(engine, greedy(ids, f"prompt-lp-{attempt}", max_tokens=2, prompt_logprobs=1, logprobs=1))
        assert output.num_cached_tokens == 0
        entries = output.prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None
        for position, entry in enumerate(entries[1:]):
            check_entry(entry, reference[position], ids[position + 1], 1)
        check_entry(output.logprobs[0], reference[-1], output.new_token_ids[0], 1)


def test_logprobs_do_not_change_the_tokens_of_a_batch(engine, prompt_ids):
    ids = [prompt_ids[i] for i in (0, 4, 12)]
    plain = collect_concurrently(engine, [greedy(p, f"plain-{i}") for i, p in enumerate(ids)])
    requests = [greedy(p, f"plain-{i}", logprobs=20 if i else None) for i, p in enumerate(ids)]
    with_logprobs = collect_concurrently(engine, requests)
    assert with_logprobs == plain


def test_min_p_one_at_temperature_one_is_greedy(engine, prompt_ids):
    ids = prompt_ids[4]
    reference = run(engine, greedy(ids, "mp-greedy", max_tokens=12, ignore_eos=True))
    for seed in (1, 2, 3):
        output = run(engine, sampled(ids, f"mp-{seed}", max_tokens=12, temperature=1.0, min_p=1.0, seed=seed))
        assert output.new_token_ids == reference.new_token_ids


def test_min_p_keeps_draws_among_likely_tokens(engine, hf_model, prompt_ids):
    ids = prompt_ids[1]
    reference = hf_logprobs(hf_model, ids)[-1].exp()
    allowed = {t for t in range(reference.numel()) if reference[t] >= 0.2 * reference.max()}
    for seed in range(8):
        output = run(engine, sampled(ids, f"mpk-{seed}", max_tokens=1, temperature=1.0, min_p=0.2, seed=seed))
        assert output.new_token_ids[0] in allowed


def test_logit_bias_forces_and_bans_tokens(engine, prompt_ids):
    ids = prompt_ids[1]
    plain = run(engine, greedy(ids, "lb-plain", max_tokens=4, ignore_eos=True))
    forced_token = engine.encode(" banana")[0]
    forced = run(
        engine, greedy(ids, "lb-force", max_tokens=3, ignore_eos=True, logit_bias={forced_token: 100.0})
    )
    assert forced.new_token_ids == [forced_token] * 3
    banned = run(
        engine,
        greedy(ids, "lb-ban", max_tokens=4, ignore_eos=True, logit_bias={plain.new_token_ids[0]: -100.0}),
    )
    assert banned.new_token_ids[0] != plain.new_token_ids[0]


def test_logit_bias_from_json_keys_and_its_bounds():
    params = SamplingParams.from_dict({"logit_bias": {"42": 5, "7": -1.5}}, max_tokens_limit=16)
    assert params.logit_bias == {42: 5, 7: -1.5}
    for bad in ({"x": 1}, {"1": 101}, {"1": math.inf}, [1, 2]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams.from_dict({"logit_bias": bad}, max_tokens_limit=16)


def test_repetition_penalty_reduces_repeats_and_one_changes_nothing(engine, prompt_ids):
    ids = prompt_ids[3]  # "1, 2, 3, 4, 5," invites repetition
    plain = run(engine, greedy(ids, "rp-plain", max_tokens=24, ignore_eos=True))
    same = run(engine, greedy(ids, "rp-one", max_tokens=24, ignore_eos=True, repetition_penalty=1.0))
    penalized = run(engine, greedy(ids, "rp", max_tokens=24, ignore_eos=True, repetition_penalty=1.8))
    assert same.new_token_ids == plain.new_token_ids
    repeats = lambda tokens: len(tokens) - len(set(tokens))  # noqa: E731
    assert repeats(penalized.new_token_ids) < repeats(plain.new_token_ids)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 21),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
    ],
)
def test_out_of_range_fields_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value}, max_tokens_limit=16)
