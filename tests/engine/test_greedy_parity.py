"""Greedy output must be token-identical to transformers' generate on the same fp32 weights."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, collect_concurrently, engine_config, greedy, run

from server.engine.llm_engine import LLMEngine
from server.engine.stream import iterate_outputs


def test_sequential_matches_transformers(engine, prompt_ids, reference_outputs):
    assert len(PROMPTS) >= 20
    assert max(len(ids) for ids in prompt_ids) >= 300
    for index, ids in enumerate(prompt_ids):
        output = run(engine, greedy(ids, f"seq-{index}"))
        assert output.new_token_ids == reference_outputs[index], f"prompt {index}: {PROMPTS[index]!r:.60}"
        assert output.num_prompt_tokens == len(ids)
        assert output.num_output_tokens == len(reference_outputs[index])


def test_concurrent_batch_matches_transformers(engine, prompt_ids, reference_outputs):
    requests = [greedy(ids, f"batch-{i}") for i, ids in enumerate(prompt_ids)]
    tokens = collect_concurrently(engine, requests)
    for index in range(len(prompt_ids)):
        assert tokens[f"batch-{index}"] == reference_outputs[index], f"prompt {index}"


def test_prefix_cached_requests_match(engine, prompt_ids, reference_outputs):
    """The earlier tests left these prompts' full blocks in the cache: outputs must not change."""
    cached = 0
    for index, ids in enumerate(prompt_ids):
        output = run(engine, greedy(ids, f"cached-{index}"))
        assert output.new_token_ids == reference_outputs[index], f"prompt {index}"
        assert output.num_cached_tokens <= len(ids) - 1
        cached += output.num_cached_tokens
        if len(ids) > 32:
            assert output.num_cached_tokens >= 16, f"prompt {index} of {len(ids)} tokens had no prefix hit"
    assert cached > 0


def test_shared_prefix_then_divergence(engine, prompt_ids):
    """Two prompts sharing a long prefix: the second hits the first's blocks and still matches its own run."""
    base = prompt_ids[13]
    first = run(engine, greedy(base + engine.encode(" Point one:"), "fork-a"))
    second = run(engine, greedy(base + engine.encode(" In short,"), "fork-b"))
    fresh = LLMEngine(engine_config(num_kv_blocks=64))
    try:
        expected = run(fresh, greedy(base + engine.encode(" In short,"), "fork-b-fresh"))
    finally:
        fresh.close()
    assert first.finish_reason in ("stop", "length")
    assert second.num_cached_tokens >= (len(base) // 16 - 1) * 16
    assert second.new_token_ids == expected.new_token_ids


@pytest.mark.parametrize("paged_kernel", [True, False], ids=["kernel", "gather"])
def test_preemption_by_recompute_matches(prompt_ids, reference_outputs, paged_kernel):
    """A pool too small for all requests at once forces preemption; outputs must stay identical, whether the
    compiled kernels run (decode attention from the pool, fused elementwise ops) or torch does it all (blocks
    gathered for SDPA, grouped by length and masked; RMSNorm, RoPE, SiLU as torch ops)."""
    picked = [i for i, ids in enumerate(prompt_ids) if len(ids) < 200][:10]
    longest = max(len(prompt_ids[i]) for i in picked) + 16
    config = engine_config(
        num_kv_blocks=-(-longest // 16) + 8, max_num_batched_tokens=256, paged_kernel=paged_kernel,
        fused_ops=paged_kernel,
    )  # fmt: skip
    tiny = LLMEngine(config)
    assert (tiny.model.decode_kernel is not None) == paged_kernel
    assert (tiny.model.fused is not None) == paged_kernel
    try:
        tokens = collect_concurrently(tiny, [greedy(prompt_ids[i], f"pre-{i}") for i in picked])
        stats = tiny.stats()
        assert stats.num_preemptions > 0
        assert stats.num_free_blocks == stats.num_blocks
    finally:
        tiny.close()
    for index in picked:
        assert tokens[f"pre-{index}"] == reference_outputs[index], f"prompt {index}"


def test_streaming_text_is_the_decoded_tokens(engine, prompt_ids):
    pieces, tokens = [], []
    for output in iterate_outputs(engine, greedy(prompt_ids[9], "stream", max_tokens=24, ignore_eos=True)):
        pieces.append(output.new_text)
        tokens.extend(output.new_token_ids)
        assert "\ufffd" not in output.new_text
    assert len(tokens) == 24
    assert "".join(pieces) == engine.decode(tokens)
