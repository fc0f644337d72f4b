"""The Mooncake conversation trace (bench/data/mooncake): its requests, the token ids a hash id stands for, the
prefix hits an unlimited cache would get, the time compression of a replay, and the flags that pick a slice.

A trace row is one request: `timestamp` (ms), `input_length`, `output_length` (tokens) and `hash_ids`, one id per
512-token block, equal leading ids meaning an equal prefix. Id 0 is the system prompt every conversation shares;
the second id names the conversation.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.servers import ROOT

TRACE = ROOT / "bench" / "data" / "mooncake" / "conversation_trace.jsonl"
FIRST_TOKEN_ID, VOCAB = 100, 49152  # SmolLM2's vocabulary above its special tokens (0-16)

_FLAGS: dict[str, tuple[type, str]] = {
    "conversations": (int, "whole conversations of the Mooncake trace, the first ones in trace order"),
    "min_turns": (int, "only conversations with at least this many requests"),
    "max_output": (int, "output tokens cap of a request (the trace's output length, capped)"),
    "max_blocks": (int, "prompt blocks kept (a prefix of the hash ids)"),
    "block_tokens": (int, "tokens per trace hash id: one KV block (the trace's own are 512)"),
    "duration_s": (float, "the slice's arrivals are compressed to span this long, seconds"),
}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # trace time
    hash_ids: list[int]  # one per block; equal leading ids = equal prefix
    output_tokens: int


def read_trace(path: Path = TRACE) -> list[dict]:
    """The trace's rows, in trace (arrival) order."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _conversation(row: dict) -> int:
    """The second hash id names a conversation (the first, 0, is the shared system prompt); -1: none."""
    return row["hash_ids"][1] if len(row["hash_ids"]) > 1 else -1


def load_conversations(
    conversations: int, min_turns: int, max_output: int, max_blocks: int | None = None, path: Path = TRACE
) -> list[TraceRequest]:
    """All requests of the first `conversations` conversations having >= `min_turns` requests, in trace order,
    outputs capped at `max_output` tokens, hash ids cut to their first `max_blocks` (a prefix stays a prefix)."""
    rows = read_trace(path)
    turns = Counter(_conversation(row) for row in rows)
    chosen: set[int] = set()
    for row in rows:
        conversation = _conversation(row)
        if conversation >= 0 and turns[conversation] >= min_turns and len(chosen) < conversations:
            chosen.add(conversation)
    return [
        TraceRequest(
            row["timestamp"] / 1000, row["hash_ids"][:max_blocks], min(row["output_length"], max_output)
        )
        for row in rows
        if _conversation(row) in chosen
    ]


def block_tokens(block_id: int, tokens: int) -> list[int]:
    """The `tokens` token ids hash id `block_id` stands for: drawn by a numpy RNG seeded with the id, so equal ids
    give equal blocks (prefixes match) and distinct ids distinct ones."""
    return np.random.default_rng(block_id).integers(FIRST_TOKEN_ID, VOCAB, tokens).tolist()


def prompt_tokens(hash_ids: Sequence[int], tokens_per_block: int) -> list[int]:
    """The token ids of a prompt of these blocks."""
    return [token for block_id in hash_ids for token in block_tokens(block_id, tokens_per_block)]


def distinct_prompts(conversations: int, max_blocks: int, tokens_per_block: int = 16) -> list[list[int]]:
    """The distinct token-id prompts of the first `conversations` conversations with >= 2 turns (<= `max_blocks`
    blocks each), in trace order."""
    requests = load_conversations(conversations, min_turns=2, max_output=1, max_blocks=max_blocks)
    prompts = dict.fromkeys(tuple(prompt_tokens(r.hash_ids, tokens_per_block)) for r in requests)
    return [list(prompt) for prompt in prompts]


def oracle_sources(requests: Sequence[TraceRequest]) -> list[tuple[int, int]]:
    """Per request: (leading blocks an unlimited cache holds, i.e. ids seen in earlier requests; index of the latest
    earlier request holding the last of them, -1 with no hit): the request whose prefill must have finished, on
    the same worker, for the hit."""
    holder: dict[int, int] = {}  # block id -> latest request index containing it
    sources = []
    for i, request in enumerate(requests):
        hits = 0
        while hits < len(request.hash_ids) and request.hash_ids[hits] in holder:
            hits += 1
        sources.append((hits, holder[request.hash_ids[hits - 1]] if hits else -1))
        holder.update((block_id, i) for block_id in request.hash_ids)
    return sources


def oracle_hit_rate(requests: Sequence[TraceRequest]) -> float:
    """Share of all blocks that are prefix hits with one unlimited cache (the bound for any router or tier)."""
    hits = sum(hit for hit, _ in oracle_sources(requests))
    return hits / max(1, sum(len(r.hash_ids) for r in requests))


def compression(last_arrival_s: float, duration_s: float) -> float:
    """How many times faster than the trace a replay runs so that its arrivals span `duration_s` (>= 1: a replay
    is never slower than the trace)."""
    return max(1.0, last_arrival_s / duration_s)


def trace_prompts(
    args: argparse.Namespace,
) -> tuple[list[tuple[float, list[int], int]], float, list[tuple[int, int]]]:
    """(arrival_s, prompt token ids, max_tokens) of the slice the trace flags in `args` pick, its oracle hit rate
    and oracle sources."""
    requests = load_conversations(args.conversations, args.min_turns, args.max_output, args.max_blocks)
    prompts = [
        (r.arrival_s, prompt_tokens(r.hash_ids, args.block_tokens), max(1, r.output_tokens)) for r in requests
    ]
    return prompts, oracle_hit_rate(requests), oracle_sources(requests)


def add_trace_flags(parser: argparse.ArgumentParser, **defaults: float) -> None:
    """Add to `parser` the trace flags named in `defaults` (conversations, min_turns, max_output, max_blocks,
    block_tokens, duration_s), each with its default: every benchmark that replays the trace spells and explains
    them alike."""
    for name, default in defaults.items():
        kind, text = _FLAGS[name]
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, help=text)
