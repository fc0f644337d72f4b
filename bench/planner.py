"""The SLA planner under a load ramp: `strata serve --planner` (local connector) next to fixed worker counts.

    python bench/planner.py [--duration-s 600] [--ttft-target 1.5] [--itl-target 0.06]

Setup, all on this host: a throwaway Redis; a repository holding SmolLM2 with one torch thread per worker; the
worker profile measured first with `strata profile` on that repository (a small grid, about a minute). Then three
runs of the same ramp, each on a fresh `strata serve --workers 0 --accept-remote-workers`:

    fixed-min   `--min-workers` `strata worker` processes started by the bench, for the whole run
    fixed-max   `--max-workers` of them
    planner     none started by the bench: `strata serve --planner` scales them between min and max

Load: Mooncake conversation turns (bench/data/mooncake, in trace order, so later turns reuse earlier turns'
prefixes; prompts capped at `--max-blocks` blocks of 16 tokens, outputs at `--max-output` tokens), streamed over
the OpenAI API, arriving as a Poisson process whose rate ramps low -> high -> low:

    |  low  | ramp up |  high  | ramp down |  low  |     (3/10, 3/20, 3/20, 3/20, rest of the duration)

`low` and `high` come from the profile, not from a guess: `high` is `--peak-share` of what `--max-workers` carry
at the targets (server/planner/sizing.py), `low` is `--low-share` of what one worker carries.

Reported per run: SLA attainment (share of requests whose TTFT and whose own mean ITL both meet the targets;
errors count as misses), TTFT and ITL p50/p90, errors, and worker-seconds (every `strata worker` process alive,
loading and draining included, sampled each second from /proc over the load window). The goal (issue 17): the
planner keeps at least 95 % of fixed-max's attainment with at most 70 % of its worker-seconds. A PNG of the
timeline (rate, workers, per-request TTFT and ITL) is saved next to the JSON in bench/results/.

The report (bench/results/planner.json and the JSON line) records the date, the machine (CPU model, cores) and
the git commit of the run. Runs taken from `--baseline-json` keep the date, machine and commit of the report they
come from (`from`, `measured_on`) and are marked "baseline" in the table; runs made now are marked "now".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from bench.machine import describe, machine  # noqa: E402
from harness.load import StreamTiming, drive  # noqa: E402
from harness.redis_server import RedisServer  # noqa: E402
from harness.servers import smollm2_repository, start_strata, use_run_secret  # noqa: E402
from harness.stats import percentile  # noqa: E402
from harness.trace import add_trace_flags, load_conversations, prompt_tokens  # noqa: E402
from harness.waiting import wait_for  # noqa: E402
from server.planner.profile import load as load_profile  # noqa: E402
from server.planner.sizing import Bounds, Load, Targets, aggregated_workers  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PHASES = (0.3, 0.15, 0.15, 0.15)  # low, ramp up, high, ramp down; the rest is low again


def rate_at(t: float, duration: float, low: float, high: float) -> float:
    edges = [sum(PHASES[:i]) * duration for i in range(1, 5)]  # ends of: low, ramp up, high, ramp down
    if t < edges[0] or t >= edges[3]:
        return low
    if t < edges[1]:
        return low + (high - low) * (t - edges[0]) / (edges[1] - edges[0])
    if t < edges[2]:
        return high
    return high - (high - low) * (t - edges[2]) / (edges[3] - edges[2])


def arrivals(duration: float, low: float, high: float, seed: int) -> list[float]:
    """Poisson arrivals with the ramp's rate (thinning)."""
    rng, t, times = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(high)
        if t >= duration:
            return times
        if rng.random() < rate_at(t, duration, low, high) / high:
            times.append(t)


def workload(args: argparse.Namespace, times: list[float]) -> list[tuple[float, list[int], int]]:
    turns = load_conversations(800, 2, args.max_output, args.max_blocks)
    if len(turns) < len(times):
        raise SystemExit(f"{len(times)} requests wanted, the trace slice has {len(turns)}")
    return [
        (t, prompt_tokens(turn.hash_ids, 16), max(4, turn.output_tokens))
        for t, turn in zip(times, turns, strict=False)
    ]


def profile(repository: Path, path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "server", "profile", "--model-repository", str(repository), "--model", "smollm2",
         "--output", str(path), "--prompt-lengths", "64,256,512", "--concurrency", "1,2,4,8",
         "--contexts", "256,512", "--decode-tokens", "16", "--repeats", "2"],
        check=True,
    )  # fmt: skip


def worker_processes(tag: str) -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        count += b"\0worker\0" in cmdline and tag.encode() in cmdline
    return count


def start_workers(repository: Path, redis_url: str, count: int, log_dir: Path) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server",
                "worker",
                "--model-repository",
                str(repository),
                "--model",
                "smollm2",
                "--redis-url",
                redis_url,
                "--worker-id",
                f"fixed-{i}",
                "--host",
                "127.0.0.1",
                "--no-kvbm",
            ],
            stdout=open(log_dir / f"fixed-{i}.log", "w"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for i in range(count)
    ]


def run(
    name: str, args: argparse.Namespace, repository: Path, profile_path: Path, requests, tmp: Path
) -> dict:
    redis = RedisServer()
    redis.start()
    flags = ["--workers", "0", "--no-kvbm", "--accept-remote-workers", "--redis-url", redis.url]
    if name == "planner":
        flags += ["--planner", "smollm2", "--planner-profile", str(profile_path), "--ttft-target",
                  str(args.ttft_target), "--itl-target", str(args.itl_target), "--adjustment-interval",
                  str(args.interval_s), "--min-workers", str(args.min_workers), "--max-workers",
                  str(args.max_workers), "--max-total-workers", str(args.max_workers), "--scale-down-intervals",
                  str(args.scale_down_intervals),
                  "--planner-worker-args=--no-kvbm"]  # fmt: skip
    server = start_strata(repository, tmp / name, *flags)
    tag = f"smollm2-both-{server.process.pid}-" if name == "planner" else "fixed-"
    fixed = []
    if name != "planner":
        fixed = start_workers(repository, redis.url, args.min_workers if name == "fixed-min" else args.max_workers,
                              tmp / name)  # fmt: skip
    expected = args.min_workers if name != "fixed-max" else args.max_workers
    wait_for(
        lambda: server.log().count("joined") >= expected, 180, interval=0.5, what=f"{expected} workers joined"
    )
    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        started = time.perf_counter()
        while not stop.wait(1.0):
            samples.append((time.perf_counter() - started, worker_processes(tag)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()  # drive's clock starts here: the ramp's time 0
    timings = relative(drive(server.openai_url, requests), started)
    stop.set()
    sampler.join()
    log = server.log()
    server.stop()
    for process in fixed:
        process.terminate()
        process.wait(60)
    redis.stop()
    return summarize(name, timings, samples, requests, args) | {"scaling_log": _decisions(log)}


def relative(timings: list[StreamTiming], started: float) -> list[StreamTiming]:
    """The timings in seconds since `started` (perf_counter s), for the timeline."""
    for timing in timings:
        for attr in ("first_token", "finished"):
            if getattr(timing, attr) is not None:
                setattr(timing, attr, getattr(timing, attr) - started)
        timing.chunk_times = [t - started for t in timing.chunk_times]
        timing.submitted -= started
    return timings


def request_itl(timing: StreamTiming) -> float | None:
    if len(timing.chunk_times) < 2:
        return None
    return (timing.chunk_times[-1] - timing.chunk_times[0]) / (timing.completion_tokens - 1)


def summarize(name: str, timings, samples, requests, args) -> dict:
    ok = [t for t in timings if t.error is None and t.first_token is not None]
    ttft = [t.first_token - t.submitted for t in ok]
    itl = [v for t in ok if (v := request_itl(t)) is not None]
    met = sum(
        1 for t in ok
        if t.first_token - t.submitted <= args.ttft_target and (request_itl(t) or 0.0) <= args.itl_target
    )  # fmt: skip
    window = max(samples[-1][0], 1.0) if samples else 1.0
    worker_s = sum(count for _, count in samples)  # one sample a second

    return {
        "run": name, "requests": len(timings), "errors": len(timings) - len(ok),
        "sla_attainment": round(met / max(1, len(timings)), 4),
        "ttft_p50_s": round(percentile(ttft, 50), 3), "ttft_p90_s": round(percentile(ttft, 90), 3),
        "itl_p50_s": round(percentile(itl, 50), 3), "itl_p90_s": round(percentile(itl, 90), 3),
        "worker_seconds": worker_s, "window_s": round(window, 1),
        "workers_timeline": samples,
        "requests_timeline": [(round(t.submitted, 2), round((t.first_token or t.finished) - t.submitted, 3),
                               request_itl(t), t.error is None) for t in timings],
        "first_errors": [t.error for t in timings if t.error][:3],
    }  # fmt: skip


def _decisions(log: str) -> list[str]:
    return [
        line.split("planner smollm2: ", 1)[1]
        for line in log.splitlines()
        if "planner smollm2: observed" in line
    ]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rate_ax, workers_ax, ttft_ax, itl_ax) = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    duration, low, high = report["duration_s"], report["rate_low"], report["rate_high"]
    xs = [i for i in range(int(duration))]
    rate_ax.plot(xs, [rate_at(x, duration, low, high) for x in xs], color="black")
    rate_ax.set_ylabel("arrival rate, req/s")
    for run in report["runs"]:
        workers_ax.step([s[0] for s in run["workers_timeline"]], [s[1] for s in run["workers_timeline"]],
                        label=run["run"], where="post")  # fmt: skip
        points = run["requests_timeline"]
        ttft_ax.scatter([p[0] for p in points], [p[1] for p in points], s=6, label=run["run"])
        itl_ax.scatter([p[0] for p in points if p[2]], [p[2] for p in points if p[2]], s=6, label=run["run"])
    ttft_ax.axhline(report["ttft_target_s"], color="red", linestyle="--", linewidth=0.8)
    itl_ax.axhline(report["itl_target_s"], color="red", linestyle="--", linewidth=0.8)
    workers_ax.set_ylabel("worker processes")
    ttft_ax.set_ylabel("TTFT, s")
    ttft_ax.set_yscale("log")
    itl_ax.set_ylabel("request ITL, s")
    itl_ax.set_xlabel("seconds since the ramp started")
    for axis in (workers_ax, ttft_ax, itl_ax):
        axis.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def baseline_runs(path: Path, made: set[str], ramp: tuple[float, float, int]) -> list[dict]:
    """The runs of an earlier report at `path` not made now, each marked with where and when it was measured
    (its report's machine: date, CPU, cores, commit; empty where that report predates them)."""
    earlier = json.loads(path.read_text())
    if (earlier["rate_low"], earlier["rate_high"], earlier["requests"]) != ramp:
        raise SystemExit(f"{path}: another ramp (profile or seed differ)")
    marks = {"measured": "baseline", "from": str(path), "measured_on": earlier.get("machine", {})}
    rows = []
    for row in earlier["runs"]:
        if row["run"] in made:
            continue
        # a run the earlier report itself took from a baseline keeps that origin
        rows.append({"measured": "baseline", "measured_on": {}} | row if "from" in row else row | marks)
    return rows


def print_table(report: dict) -> None:
    """One row per run; "measured" says whether it ran now or comes from a baseline report (listed below)."""
    print(f"\nthis run: {describe(report['machine'])}")
    print(f"{'run':>10} {'measured':>9} {'reqs':>5} {'err':>4} {'SLA':>6} {'TTFT p50/p90 s':>15} "
          f"{'ITL p50/p90 s':>15} {'worker-s':>9}")  # fmt: skip
    for r in report["runs"]:
        print(f"{r['run']:>10} {r.get('measured', 'baseline'):>9} {r['requests']:>5} {r['errors']:>4} "
              f"{r['sla_attainment']:>6.1%} {r['ttft_p50_s']:>7.2f}/{r['ttft_p90_s']:<7.2f} "
              f"{r['itl_p50_s']:>7.3f}/{r['itl_p90_s']:<7.3f} {r['worker_seconds']:>9}")  # fmt: skip
    for r in report["runs"]:
        if r.get("measured") != "now":
            origin = describe(r.get("measured_on", {}))
            print(f"  {r['run']}: baseline from {r.get('from')}, measured {origin}")
    if "attainment_vs_fixed_max" in report:
        compared = [r for r in report["runs"] if r["run"] in ("planner", "fixed-max")]
        mixed = any(r.get("measured") != "now" for r in compared)
        print(f"planner / fixed-max: attainment {report['attainment_vs_fixed_max']:.1%} (goal >= 95 %), "
              f"worker-seconds {report['worker_seconds_vs_fixed_max']:.1%} (goal <= 70 %)"
              + ("; one of the two is a baseline row measured another time" if mixed else ""))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--ttft-target", type=float, default=1.5)
    parser.add_argument("--itl-target", type=float, default=0.06)
    parser.add_argument("--interval-s", type=float, default=10.0, help="the planner's --adjustment-interval")
    parser.add_argument(
        "--scale-down-intervals", type=int, default=2, help="the planner's window: 20 s at the 10 s interval"
    )
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--max-workers", type=int, default=2)
    parser.add_argument(
        "--peak-share", type=float, default=0.8, help="of max-workers' capacity at the targets"
    )
    parser.add_argument(
        "--low-share", type=float, default=0.4, help="of one worker's capacity at the targets"
    )
    add_trace_flags(parser, max_blocks=24, max_output=32)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--runs", default="fixed-min,fixed-max,planner")
    parser.add_argument(
        "--profile", type=Path, default=None, help="reuse this profile (same ramp and requests)"
    )
    parser.add_argument(
        "--baseline-json",
        type=Path,
        default=None,
        help="take the runs not made now from this earlier report (same profile and seed)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="write the figure (PNG) here (default bench/results/planner.png)",
    )
    args = parser.parse_args()
    use_run_secret()
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="plan") as scratch:
        tmp = Path(scratch)
        # dtype: the example's (copy_models pins fp32)
        repository = smollm2_repository(tmp, num_threads=1, max_num_batched_tokens=512, dtype="auto")
        profile_path = args.profile or RESULTS / "planner-profile.json"
        if args.profile is None:
            profile(repository, profile_path)
        worker_profile = load_profile(profile_path)
        probe = workload(args, [0.0] * 200)
        prompt = statistics.mean(len(p) for _, p, _ in probe)
        output = statistics.mean(m for _, _, m in probe)
        targets = Targets(args.ttft_target, args.itl_target)

        def capacity(
            workers: int,
        ) -> float:  # the highest rate `workers` carry at the targets, per the profile
            rate = 0.01
            while aggregated_workers(worker_profile, Load(rate + 0.01, prompt, output), targets,
                                     Bounds(0, 64, 0, 64, 64), args.interval_s).decode <= workers:  # fmt: skip
                rate += 0.01
            return rate

        low, high = args.low_share * capacity(1), args.peak_share * capacity(args.max_workers)
        requests = workload(args, arrivals(args.duration_s, low, high, args.seed))
        print(f"ramp {low:.2f} -> {high:.2f} req/s over {args.duration_s:.0f} s: {len(requests)} requests, "
              f"mean prompt {prompt:.0f} tokens, mean output {output:.0f}", flush=True)  # fmt: skip
        runs = [run(name, args, repository, profile_path, requests, tmp) for name in args.runs.split(",")]
    runs = [r | {"measured": "now"} for r in runs]
    # e.g. re-run the planner alone against the fixed runs of the same ramp
    if args.baseline_json is not None:
        runs = baseline_runs(args.baseline_json, {r["run"] for r in runs}, (low, high, len(requests))) + runs
    report = {"bench": "planner", "machine": machine(), "duration_s": args.duration_s, "rate_low": low,
              "rate_high": high, "ttft_target_s": args.ttft_target, "itl_target_s": args.itl_target,
              "requests": len(requests), "runs": runs}  # fmt: skip
    by_name = {r["run"]: r for r in runs}
    if "planner" in by_name and "fixed-max" in by_name:
        planner, maximum = by_name["planner"], by_name["fixed-max"]
        report["attainment_vs_fixed_max"] = round(
            planner["sla_attainment"] / max(maximum["sla_attainment"], 1e-9), 3
        )
        report["worker_seconds_vs_fixed_max"] = round(
            planner["worker_seconds"] / max(maximum["worker_seconds"], 1), 3
        )
    (RESULTS / "planner.json").write_text(json.dumps(report, indent=1))
    plot(report, args.plot or RESULTS / "planner.png")
    print_table(report)
    print(f"timeline: {args.plot or RESULTS / 'planner.png'}")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}
                     | {"runs": [{k: v for k, v in r.items() if not k.endswith("timeline") and k != "scaling_log"}
                                 for r in runs]}))  # fmt: skip


if __name__ == "__main__":
    main()
