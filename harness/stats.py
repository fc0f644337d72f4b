"""The one percentile every benchmark reports: linear interpolation between the two nearest ranks.

For n sorted values x[0..n-1], the q-th percentile sits at rank r = (n - 1) * q / 100 and is
x[floor(r)] + (x[ceil(r)] - x[floor(r)]) * (r - floor(r)): numpy's default ("linear"), Excel's PERCENTILE.INC,
what aiperf and most serving benchmarks report. p0 is the minimum, p100 the maximum, and p50 the median, equal
to `statistics.median` (which benchmarks use for medians of repeated rounds), so every p50 and p90 in bench/
compares with every other.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The `q`-th percentile (0 <= q <= 100) of `values`, interpolated as the module says; NaN if there are none."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_us(seconds: list[float]) -> dict[str, float]:
    """p50, p90, p99 and mean of latencies given in seconds, in microseconds (one decimal)."""
    return {
        "p50_us": round(percentile(seconds, 50) * 1e6, 1),
        "p90_us": round(percentile(seconds, 90) * 1e6, 1),
        "p99_us": round(percentile(seconds, 99) * 1e6, 1),
        "mean_us": round(statistics.fmean(seconds) * 1e6, 1),
    }
