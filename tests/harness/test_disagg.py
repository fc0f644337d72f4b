"""The workload and the verdict of bench/disagg.py (harness/disagg.py), and its /metrics reading."""

from __future__ import annotations

import argparse

from harness.disagg import build_workload, compare, disagg_metrics, stop_rate


def _args(**overrides: object) -> argparse.Namespace:
    fields = dict(
        seed=0,
        long_share=0.2,
        long_min_tokens=1024,
        long_max_tokens=2048,
        long_output=8,
        conversations=64,
        min_turns=2,
        short_max_blocks=8,
        short_min_output=32,
        short_max_output=64,
    )
    return argparse.Namespace(**(fields | overrides))


def test_workload_is_seeded_and_each_rate_replays_a_prefix_of_it() -> None:
    requests = build_workload(_args(), 80)
    assert requests == build_workload(_args(), 80)
    assert build_workload(_args(), 30) == requests[:30]
    assert build_workload(_args(seed=1), 80) != requests
    assert all(a.arrival_s < b.arrival_s for a, b in zip(requests, requests[1:], strict=False))


def test_long_prompts_are_unique_and_in_range_short_turns_share_the_system_prompt() -> None:
    requests = build_workload(_args(), 80)
    longs = [r for r in requests if r.long]
    shorts = [r for r in requests if not r.long]
    assert 5 <= len(longs) <= 30
    assert all(1024 <= len(r.prompt) <= 2048 and r.max_tokens == 8 for r in longs)
    assert len({tuple(r.prompt[:16]) for r in longs}) == len(longs)
    assert all(len(r.prompt) <= 8 * 16 and 32 <= r.max_tokens <= 64 for r in shorts)
    assert len({tuple(r.prompt[:16]) for r in shorts}) == 1  # hash id 0: the trace's shared system prompt


def test_disagg_metrics_reads_decisions_and_transfer_rates() -> None:
    text = "\n".join(
        [
            "# HELP strata_disagg_prefills_total Prefills",
            'strata_disagg_prefills_total{model="smollm2",reason="long_prompt",where="remote"} 12.0',
            'strata_disagg_prefills_total{model="smollm2",reason="short_prompt",where="local"} 40.0',
            'strata_disagg_prefills_created{model="smollm2",reason="long_prompt",where="remote"} 1.7e+09',
            'strata_disagg_kv_transfer_bytes_total{model="smollm2",transport="shm"} 2.0e+09',
            'strata_disagg_kv_transfer_seconds_sum{model="smollm2",side="send"} 0.5',
            'strata_disagg_kv_transfer_seconds_count{model="smollm2",side="send"} 12.0',
            'strata_disagg_kv_transfer_seconds_sum{model="smollm2",side="receive"} 0.25',
            'strata_disagg_prefill_queue{model="smollm2"} 0.0',
            'strata_router_decisions_total{reason="prefix_hit",strategy="kv-aware"} 3.0',
        ]
    )
    metrics = disagg_metrics(text)
    assert metrics["prefills"] == {"remote/long_prompt": 12, "local/short_prompt": 40}
    assert metrics["transfer_gb"] == 2.0
    assert metrics["transfer_gb_s"] == {"send": 4.0, "receive": 8.0}
    assert metrics["transfers"] == {"send": 12}
    assert metrics["prefill_queue_at_end"] == 0.0
    assert disagg_metrics("")["prefills"] == {}


def test_compare_checks_each_goal() -> None:
    aggregated = {"itl_p90_ms": 400.0, "ttft_p50_s": 1.0, "throughput_tok_s": 100.0}
    good = compare(aggregated, {"itl_p90_ms": 150.0, "ttft_p50_s": 1.2, "throughput_tok_s": 95.0})
    assert good["goals_met"] == {"itl_p90": True, "ttft_p50": True, "throughput": True} and good["pays_off"]
    slow = compare(aggregated, {"itl_p90_ms": 300.0, "ttft_p50_s": 2.0, "throughput_tok_s": 95.0})
    assert slow["goals_met"]["itl_p90"] is False and slow["goals_met"]["ttft_p50"] is False
    assert not slow["pays_off"] and slow["ratios"]["ttft_p50"] == 2.0


def test_stop_rate_is_the_first_failing_rate_above_a_paying_one() -> None:
    def runs(*verdicts: bool) -> list[dict]:
        return [{"rate": i + 1.0, "comparison": {"pays_off": v}} for i, v in enumerate(verdicts)]

    assert stop_rate(runs(False, True, True, False, False)) == 4.0  # the low rate ties: not a stop
    assert stop_rate(runs(True, True)) is None
    assert stop_rate(runs(False, False)) is None
