"""Which load predictor the SLA planner should use: one-step-ahead errors of each (server/planner/predict.py) on
the Mooncake conversation trace's per-interval load, walked forward as the planner would see it.

    python bench/predictors.py [--intervals 30,60] [--trace bench/data/mooncake/conversation_trace.jsonl]

For each adjustment interval, the trace is cut into intervals and three series are built: request rate
(requests / s), mean prompt tokens and mean output tokens of the requests that arrived in the interval. Each
predictor sees the values one by one and predicts the next; the table gives the mean absolute error relative to
the series' mean (so the three series compare), and `constant` is the baseline the others are measured against.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from harness.trace import TRACE, read_trace  # noqa: E402
from server.planner.predict import PREDICTORS, make_predictor  # noqa: E402


def series(trace: Path, interval_s: float) -> dict[str, list[float]]:
    """Per interval: request rate, mean prompt and output tokens (an empty interval repeats the last means)."""
    rows = read_trace(trace)
    buckets: dict[int, list[dict]] = {}
    for row in rows:
        buckets.setdefault(int(row["timestamp"] / 1000 / interval_s), []).append(row)
    rate, prompt, output = [], [], []
    for i in range(max(buckets) + 1):
        arrived = buckets.get(i, [])
        rate.append(len(arrived) / interval_s)
        prompt.append(sum(r["input_length"] for r in arrived) / len(arrived) if arrived else prompt[-1])
        output.append(sum(r["output_length"] for r in arrived) / len(arrived) if arrived else output[-1])
    return {"request_rate": rate, "prompt_tokens": prompt, "output_tokens": output}


def relative_error(name: str, values: list[float]) -> float:
    """Mean |prediction - value| / mean(value), over every value after the first."""
    predictor, errors = make_predictor(name), []
    for value in values:
        errors.append(abs(predictor.predict() - value))
        predictor.add(value)
    errors = errors[1:]  # nothing to predict from before the first value
    return sum(errors) / len(errors) / (sum(values) / len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--intervals", default="30,60", help="comma-separated adjustment intervals, seconds")
    args = parser.parse_args()
    results = []
    print(f"{'interval':>8} {'series':>14} {'points':>6} " + " ".join(f"{p:>15}" for p in PREDICTORS))
    for interval_s in (float(v) for v in args.intervals.split(",")):
        for name, values in series(args.trace, interval_s).items():
            started = time.monotonic()
            errors = {p: relative_error(p, values) for p in PREDICTORS}
            row = {"interval_s": interval_s, "series": name, "points": len(values), "relative_mae": errors,
                   "vs_constant": {p: errors[p] / errors["constant"] for p in PREDICTORS},
                   "seconds": time.monotonic() - started}  # fmt: skip
            results.append(row)
            cells = " ".join(f"{errors[p]:7.3f} ({errors[p] / errors['constant']:4.2f})" for p in PREDICTORS)
            print(f"{interval_s:>8g} {name:>14} {len(values):>6} {cells}")
    print("relative MAE (and its ratio to constant's); lower is better")
    print(json.dumps({"bench": "predictors", "trace": args.trace.name, "results": results}))


if __name__ == "__main__":
    main()
