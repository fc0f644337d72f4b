"""Seeded sampling, top-k/top-p, penalties, stop strings, stop tokens and max_tokens."""

from __future__ import annotations

from conftest import collect_concurrently, greedy, run

from server.engine.api import GenerationRequest, RequestId, SamplingParams


def sampled(ids: list[int], request_id: str, **fields) -> GenerationRequest:
    params = SamplingParams.from_dict({"max_tokens": 16, "ignore_eos": True, **fields}, max_tokens_limit=256)
    return GenerationRequest(RequestId(request_id), list(ids), params)


def test_seeded_sampling_is_reproducible(engine, prompt_ids):
    ids = prompt_ids[4]
    first = run(engine, sampled(ids, "seed-a", temperature=1.0, seed=1234))
    again = run(engine, sampled(ids, "seed-b", temperature=1.0, seed=1234))
    other = run(engine, sampled(ids, "seed-c", temperature=1.0, seed=99))
    assert first.new_token_ids == again.new_token_ids
    assert first.new_token_ids != other.new_token_ids


def test_seeded_sampling_independent_of_batch_neighbours(engine, prompt_ids):
    ids = prompt_ids[4]
    alone = run(engine, sampled(ids, "alone", temperature=0.8, top_p=0.9, seed=7))
    requests = [sampled(ids, "crowd", temperature=0.8, top_p=0.9, seed=7)]
    requests += [sampled(prompt_ids[i], f"noise-{i}", temperature=1.0) for i in (0, 1, 2)]
    tokens = collect_concurrently(engine, requests)
    assert tokens["crowd"] == alone.new_token_ids


def test_top_k_one_is_greedy(engine, prompt_ids):
    ids = prompt_ids[1]
    reference = run(engine, greedy(ids, "g", ignore_eos=True))
    top1 = run(engine, sampled(ids, "k1", temperature=1.5, top_k=1, seed=3))
    assert top1.new_token_ids == reference.new_token_ids


def test_frequency_penalty_changes_repetitive_output(engine, prompt_ids):
    ids = prompt_ids[3]  # "1, 2, 3, 4, 5," invites repetition of ", "
    plain = run(engine, greedy(ids, "plain", max_tokens=24, ignore_eos=True))
    penalized = run(engine, greedy(ids, "pen", max_tokens=24, ignore_eos=True, frequency_penalty=2.0,
                                   presence_penalty=1.0))  # fmt: skip
    assert penalized.new_token_ids != plain.new_token_ids
    repeats = lambda tokens: len(tokens) - len(set(tokens))  # noqa: E731
    assert repeats(penalized.new_token_ids) < repeats(plain.new_token_ids)


def test_max_tokens_is_honoured(engine, prompt_ids):
    output = run(engine, greedy(prompt_ids[5], "len", max_tokens=5, ignore_eos=True))
    assert output.num_output_tokens == 5 and len(output.new_token_ids) == 5
    assert output.finish_reason == "length"


def test_stop_string_spanning_tokens_cuts_text(engine, prompt_ids):
    ids = prompt_ids[4]
    full = run(engine, greedy(ids, "full", max_tokens=24, ignore_eos=True))
    text = full.new_text
    stop = text[len(text) // 2 - 3 : len(text) // 2 + 3]  # six characters, likely across a token boundary
    assert len(stop) == 6 and stop in text
    cut = run(engine, greedy(ids, "cut", max_tokens=24, ignore_eos=True, stop=[stop, "zzzzqqq"]))
    assert cut.finish_reason == "stop"
    assert cut.new_text == text[: text.index(stop)]
    assert stop not in cut.new_text


def test_stop_token_ids(engine, prompt_ids):
    ids = prompt_ids[4]
    full = run(engine, greedy(ids, "st-full", max_tokens=12, ignore_eos=True))
    stop_token = full.new_token_ids[5]
    first = full.new_token_ids.index(stop_token)
    out = run(engine, greedy(ids, "st", max_tokens=12, ignore_eos=True, stop_token_ids=[stop_token]))
    assert out.finish_reason == "stop"
    assert out.new_token_ids == full.new_token_ids[: first + 1]


def test_eos_stops_unless_ignored(engine, prompt_ids):
    ids = prompt_ids[16]  # chat: "What is the capital of France?" answers in a few tokens then <|im_end|>
    out = run(engine, greedy(ids, "eos", max_tokens=40))
    assert out.finish_reason == "stop" and out.new_token_ids[-1] in engine.eos_token_ids
    assert "<|im_end|>" not in out.new_text
    ignored = run(engine, greedy(ids, "noeos", max_tokens=out.num_output_tokens + 3, ignore_eos=True))
    assert ignored.finish_reason == "length"
