"""The one percentile of bench/: linear interpolation between the nearest ranks (numpy's default)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from harness.stats import percentile, summary_us


@pytest.mark.parametrize(
    "values", [[3.0], [5.0, 1.0], [4.0, 1.0, 3.0, 2.0], list(np.random.default_rng(0).random(101))]
)
@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_is_numpys_linear_one(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_p50_is_the_median_and_no_values_give_nan() -> None:
    values = [9.0, 1.0, 4.0, 7.0]
    assert percentile(values, 50) == statistics.median(values) == 5.5
    assert math.isnan(percentile([], 50))


def test_summary_is_in_microseconds() -> None:
    assert summary_us([0.001, 0.002, 0.003]) == {
        "p50_us": 2000.0,
        "p90_us": 2800.0,
        "p99_us": 2980.0,
        "mean_us": 2000.0,
    }
