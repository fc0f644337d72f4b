"""The planner's worker-count arithmetic (server/planner/sizing.py) on a small profile; every expected count is
worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest

from server.planner.sizing import (
    Bounds,
    DecodePoint,
    Load,
    PrefillPoint,
    Targets,
    WorkerProfile,
    aggregated_workers,
    disaggregated_workers,
)

PROFILE = WorkerProfile(
    prefill=(PrefillPoint(128, 0.1), PrefillPoint(512, 0.3), PrefillPoint(2048, 1.1)),
    decode=(
        DecodePoint(1, 512, 0.02), DecodePoint(1, 2048, 0.03),
        DecodePoint(8, 512, 0.04), DecodePoint(8, 2048, 0.06),
        DecodePoint(32, 512, 0.10), DecodePoint(32, 2048, 0.16),
    ),
)  # fmt: skip
TARGETS = Targets(ttft_s=1.0, itl_s=0.05)
# prefill at 512 tokens: S = 0.3 s; rho_max = 2 (1 - 0.3) / (2 - 0.3) = 0.8235; 0.8235 * 512 / 0.3 = 1405.5 tok/s
# decode at context 512 + 64/2 = 544: ITL(8) = 0.04 + 0.02 * 32/1536 = 0.04042 <= 0.05 (ITL(32) = 0.1013 is not):
#   8 / 0.04042 = 197.9 tok/s


def test_interpolation_between_and_beyond_measured_points() -> None:
    assert PROFILE.ttft(1280) == pytest.approx(0.7)  # halfway between 512 and 2048
    assert PROFILE.ttft(4096) == pytest.approx(2.1666, abs=1e-3)  # the 512-2048 slope, extended
    assert PROFILE.itl(8, 544) == pytest.approx(0.040417, abs=1e-6)
    assert PROFILE.itl(4, 544) is None  # not a measured concurrency
    assert PROFILE.prefill_capacity(512, 1.0) == pytest.approx(1405.49, abs=0.01)
    assert PROFILE.decode_capacity(544, 0.05) == pytest.approx(197.94, abs=0.01)


@pytest.mark.parametrize(
    ("load", "bounds", "expected"),
    [
        # 2 req/s: prefill 1024 / 1405.5 = 0.73 -> 1; decode 128 / 197.9 = 0.65 -> 1
        (Load(2, 512, 64), Bounds(), (1, 1, "ok")),
        # 8 req/s: prefill 4096 / 1405.5 = 2.91 -> 3; decode 512 / 197.9 = 2.59 -> 3
        (Load(8, 512, 64), Bounds(), (3, 3, "ok")),
        # a burst queued 20,000 prompt tokens (10 s interval): prefill (1024 + 2000) / 1405.5 = 2.15 -> 3
        (Load(2, 512, 64, queued_prompt_tokens=20_000), Bounds(), (3, 1, "ok")),
        # 8 req/s within a budget of 4: prefill floor(3 * 4/6) = 2, decode the other 2
        (Load(8, 512, 64), Bounds(max_total=4), (2, 2, "total budget")),
        # 8 req/s with at most 2 decode workers
        (Load(8, 512, 64), Bounds(max_decode=2), (3, 2, "max workers")),
        # idle: the minimums (no prefill worker, one decode worker)
        (Load(0, 512, 64), Bounds(), (0, 1, "ok")),
    ],
)
def test_disaggregated_counts(load: Load, bounds: Bounds, expected: tuple[int, int, str]) -> None:
    counts = disaggregated_workers(PROFILE, load, TARGETS, bounds, interval_s=10)
    assert (counts.prefill, counts.decode, counts.reason) == expected


def test_unreachable_targets_take_the_maximum_and_say_why() -> None:
    counts = disaggregated_workers(PROFILE, Load(1, 512, 64), Targets(0.25, 0.01), Bounds(), interval_s=10)
    assert (counts.prefill, counts.decode) == (8, 8) and math.isinf(counts.prefill_need)
    assert (
        counts.reason == "ttft target below one prompt's prefill; itl target below one stream's; max workers"
    )


def test_aggregated_workers_add_prefill_and_decode_time() -> None:
    # per request 512 / 1405.5 + 64 / 197.9 = 0.3643 + 0.3233 = 0.6876 worker-seconds; at 2 req/s 1.375 -> 2
    counts = aggregated_workers(PROFILE, Load(2, 512, 64), TARGETS, Bounds(), interval_s=10)
    assert (counts.prefill, counts.decode) == (0, 2) and counts.decode_need == pytest.approx(1.3752, abs=1e-3)


def test_a_profile_with_duplicate_points_is_refused() -> None:
    with pytest.raises(ValueError, match="two prefill points"):
        WorkerProfile((PrefillPoint(1, 0.1), PrefillPoint(1, 0.2)), (DecodePoint(1, 1, 0.1),))
