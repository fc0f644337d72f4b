"""The Mooncake trace helpers every benchmark shares: slices, token ids, the oracle, compression, the flags."""

from __future__ import annotations

import argparse

import pytest

from harness.trace import (
    TraceRequest,
    add_trace_flags,
    block_tokens,
    compression,
    distinct_prompts,
    load_conversations,
    oracle_hit_rate,
    oracle_sources,
    trace_prompts,
)


def test_a_slice_is_whole_conversations_in_trace_order_cut_and_capped() -> None:
    requests = load_conversations(conversations=3, min_turns=3, max_output=8, max_blocks=5)
    conversations = {r.hash_ids[1] for r in requests}
    assert len(conversations) == 3
    assert all(len(r.hash_ids) <= 5 and r.output_tokens <= 8 for r in requests)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert all(sum(r.hash_ids[1] == c for r in requests) >= 3 for c in conversations)


def test_equal_ids_give_equal_blocks_and_distinct_ids_distinct_ones() -> None:
    # pinned: the same ids in every process and on every host (a salted hash() or a process-wide RNG would move
    # them), so prefixes built in a bench's client match those its servers cached
    assert block_tokens(7, 8) == [46449, 30762, 33660, 44110, 28466, 38148, 40992, 11146]
    assert block_tokens(7, 16)[:8] == block_tokens(7, 8)
    assert block_tokens(7, 16) != block_tokens(40_007, 16)
    assert len(block_tokens(7, 32)) == 32 and all(100 <= t < 49152 for t in block_tokens(7, 32))


def test_the_oracle_counts_leading_blocks_seen_before_and_names_their_holder() -> None:
    requests = [
        TraceRequest(0.0, [0, 1, 2], 1),
        TraceRequest(1.0, [0, 1, 3], 1),
        TraceRequest(2.0, [0, 1, 3, 4], 1),
    ]
    assert oracle_sources(requests) == [(0, -1), (2, 0), (3, 1)]
    assert oracle_hit_rate(requests) == pytest.approx(5 / 10)


def test_compression_fits_the_arrivals_into_the_duration_and_never_slows_them() -> None:
    assert compression(600.0, 60.0) == 10.0
    assert compression(30.0, 60.0) == 1.0


def test_distinct_prompts_are_deterministic_distinct_and_share_the_system_prompt() -> None:
    prompts = distinct_prompts(conversations=4, max_blocks=6)
    assert prompts == distinct_prompts(conversations=4, max_blocks=6)
    assert len({tuple(p) for p in prompts}) == len(prompts)
    assert all(len(p) % 16 == 0 and len(p) <= 6 * 16 for p in prompts)
    assert len({tuple(p[:16]) for p in prompts}) == 1  # every conversation starts with the system prompt


def test_the_trace_flags_pick_the_slice_a_bench_replays() -> None:
    parser = argparse.ArgumentParser()
    add_trace_flags(parser, conversations=4, min_turns=2, max_output=8, max_blocks=6, block_tokens=16)
    args = parser.parse_args(["--conversations", "2", "--block-tokens", "32"])
    assert (args.conversations, args.min_turns, args.block_tokens) == (2, 2, 32)
    prompts, oracle, sources = trace_prompts(args)
    assert len(prompts) == len(sources) and 0 < oracle < 1
    assert all(len(tokens) % 32 == 0 and 1 <= max_tokens <= 8 for _, tokens, max_tokens in prompts)
    with pytest.raises(SystemExit):
        parser.parse_args(["--duration-s", "9"])  # only the flags asked for exist
