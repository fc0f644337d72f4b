"""The workload and the verdict of bench/disagg.py, apart from the servers it runs: the seeded mix of long prompts
and short conversation turns, the strata_disagg_* series of a /metrics page, and whether disaggregation pays off
(tests/harness/test_disagg.py checks them)."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any

from harness.metrics import samples
from harness.trace import load_conversations, prompt_tokens

ITL_GOAL, TTFT_GOAL, THROUGHPUT_GOAL = 0.5, 1.3, 0.9  # disaggregated / aggregated
BLOCK_TOKENS = 16  # tokens per trace hash id: one KV block


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float  # at rate 1 request/s; divided by the rate
    prompt: list[int]  # token ids
    max_tokens: int
    long: bool


def short_turns(args: argparse.Namespace, count: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) of the first `count` turns of the chosen conversations, in trace order."""
    turns = load_conversations(
        args.conversations, args.min_turns, args.short_max_output, args.short_max_blocks
    )
    if len(turns) < count:
        raise ValueError(
            f"{count} short turns wanted, {args.conversations} conversations of >= {args.min_turns} turns have "
            f"{len(turns)}: raise --conversations"
        )
    return [
        (prompt_tokens(turn.hash_ids, BLOCK_TOKENS), max(args.short_min_output, turn.output_tokens))
        for turn in turns[:count]
    ]


def build_workload(args: argparse.Namespace, count: int) -> list[Request]:
    """`count` requests at rate 1; the first k are the same for any count >= k (so rates share a prefix)."""
    rng = random.Random(args.seed)
    arrivals: list[tuple[float, list[int] | None]] = []  # (time, the long prompt or None for a short turn)
    clock = 0.0
    for _ in range(count):
        clock += rng.expovariate(1.0)
        long_prompt = None
        if rng.random() < args.long_share:
            length = rng.randint(args.long_min_tokens, args.long_max_tokens)
            long_prompt = [rng.randrange(1000, 41_000) for _ in range(length)]
        arrivals.append((clock, long_prompt))
    shorts = iter(short_turns(args, sum(prompt is None for _, prompt in arrivals)))
    return [
        Request(arrival_s, prompt, args.long_output, True)
        if prompt is not None
        else Request(arrival_s, *next(shorts), False)
        for arrival_s, prompt in arrivals
    ]


def disagg_metrics(text: str) -> dict[str, Any]:
    """The strata_disagg_* series of a /metrics page: prefill decisions by where/reason, transfer bytes, seconds
    and GB/s per side, and the prefill queue gauge (an empty `prefills` for a server without prefill workers)."""
    prefills = {
        f"{labels.get('where')}/{labels.get('reason')}": int(value)
        for labels, value in samples(text, "strata_disagg_prefills_total")
    }
    transfer_bytes = sum(value for _, value in samples(text, "strata_disagg_kv_transfer_bytes_total"))
    seconds = {
        labels.get("side", "?"): value
        for labels, value in samples(text, "strata_disagg_kv_transfer_seconds_sum")
    }
    transfers = {
        labels.get("side", "?"): int(value)
        for labels, value in samples(text, "strata_disagg_kv_transfer_seconds_count")
    }
    queue = [value for _, value in samples(text, "strata_disagg_prefill_queue")]
    return {
        "prefills": prefills,
        "transfer_gb": round(transfer_bytes / 1e9, 3),
        "transfers": transfers,
        "transfer_seconds": {side: round(s, 4) for side, s in seconds.items()},
        "transfer_gb_s": {side: round(transfer_bytes / 1e9 / s, 2) for side, s in seconds.items() if s > 0},
        "prefill_queue_at_end": queue[-1] if queue else None,
    }


def compare(aggregated: dict[str, Any], disaggregated: dict[str, Any]) -> dict[str, Any]:
    """Ratios disaggregated / aggregated, which goals hold, and whether disaggregation pays off."""

    def ratio(key: str) -> float:
        base = aggregated[key]
        return round(disaggregated[key] / base, 3) if base else float("nan")

    ratios = {
        "itl_p90": ratio("itl_p90_ms"),
        "ttft_p50": ratio("ttft_p50_s"),
        "throughput": ratio("throughput_tok_s"),
    }
    goals = {
        "itl_p90": ratios["itl_p90"] <= ITL_GOAL,
        "ttft_p50": ratios["ttft_p50"] <= TTFT_GOAL,
        "throughput": ratios["throughput"] >= THROUGHPUT_GOAL,
    }
    pays_off = ratios["itl_p90"] < 1.0 and goals["ttft_p50"] and goals["throughput"]
    return {"ratios": ratios, "goals_met": goals, "pays_off": pays_off}


def stop_rate(runs: list[dict[str, Any]]) -> float | None:
    """The lowest rate, above one where disaggregation paid off, at which it no longer does (None: no such rate).
    Below the first paying rate the two configurations tie: prefills rarely meet decodes there."""
    paid = False
    for row in runs:
        if "comparison" not in row:
            continue
        if row["comparison"]["pays_off"]:
            paid = True
        elif paid:
            return row["rate"]
    return None
