"""Disaggregated prefill/decode against aggregated workers on the same cores, over the OpenAI API.

    python bench/disagg.py [--rates 0.25,0.5,0.75,1] [--duration-s 80] [--requests N] [--long-share 0.2]
                           [--max-local-prefill-length 512] [--max-prefill-queue-size 4] [--configs ...]
    python bench/disagg.py --quick        # smoke run: one rate (0.5 req/s), 40 s, both configurations

The default sweep takes ~19 minutes on 2 cores: each server start loads and calibrates (~40-60 s), and a run
lasts its arrivals plus the drain of what queued.

Configurations, each a fresh `strata serve` per rate (harness.servers.start_strata: free ports, wait for
readiness, SIGTERM at the end) from a private copy of the example repository whose model.json sets one torch
thread per worker (harness.servers.smollm2_repository), G1-only prefix caching (--no-kvbm) so no run starts warm:
    aggregated      --workers 2: two workers, each prefills and decodes what the router gives it
    disaggregated   --prefill-workers 1 --decode-workers 1 --max-local-prefill-length N --max-prefill-queue-size Q:
                    a prompt whose part not cached on the decode worker is longer than N tokens is prefilled on
                    the prefill worker, its KV handed to the decode worker, unless Q remote prefills are in
                    flight (then the decode worker prefills it itself, as it does every shorter prompt)
Both use two worker processes of one torch thread each: the same two cores, split two ways.
With --vllm-python, the same two on backend vllm (a Triton vLLM-backend model, fp32, blocks of 64, 256 MiB of KV
per worker, one OpenMP thread each) with the node's G2 (1 GiB) below both, since vLLM's handoff goes through it:
    vllm-aggregated      --workers 2
    vllm-disaggregated   --prefill-workers 1 --decode-workers 1 (thresholds as above)

Workload (seeded by --seed; the same requests at the same relative times for both configurations and, scaled,
for every rate): arrivals form a Poisson process at the rate; each arrival is a long prompt with probability
--long-share, else the next short conversation turn.
  short  the Mooncake conversation trace (bench/data/mooncake), all requests of its first --conversations
         conversations with at least --min-turns turns, in trace order: one hash id = one 16-token KV block of deterministic token ids
         (harness/trace.py), at most --short-max-blocks blocks, so turns of one conversation and the shared system
         prompt (hash id 0) are prefix hits; output = the trace's output length clamped to
         [--short-min-output, --short-max-output] tokens, so decoding dominates these requests.
  long   --long-min-tokens..--long-max-tokens (uniform) seeded random token ids, unique so never cached, with
         --long-output output tokens: prefill-heavy prompts that arrive while the short turns are decoding.
Requests per rate: rate x --duration-s, or --requests. Every request is streamed over /v1/completions with a
token-id prompt, temperature 0 and ignore_eos (harness.load.stream_completion), one client thread each.

Numbers, per configuration and rate:
  TTFT p50/p90       submit -> first streamed chunk, all requests (short and long also apart in the JSON)
  ITL p50/p90/p99    gaps between consecutive streamed chunks of one request, over all requests' gaps. A chunk
                     may hold several tokens (the detokenizer holds back partial characters); `tok/chunk` is the
                     mean tokens per gap ((completion tokens - 1) / (chunks - 1)), so 1.00 means per-token gaps
  long 1st gap       a long prompt's gap from its first chunk to its second: disaggregated, the handoff (KV
                     transfer, admission on the decode worker, recompute of the last partial block) and one decode
                     step; aggregated, one step of the worker that prefilled it
  output tok/s       output tokens of all requests / (last finish - first submit)
  prefills           disaggregated only, from /metrics at the end: strata_disagg_prefills_total by where/reason
                     (remote/long_prompt; local/short_prompt, queue_full, no_prefill_worker, prefill_failed)
  transfer GB/s      strata_disagg_kv_transfer_bytes_total / strata_disagg_kv_transfer_seconds_sum, per side
                     (send: the prefill worker's write; receive: the decode worker's read into its pool)
Percentiles interpolate linearly (harness/stats.py). Ratios are disaggregated / aggregated at the same rate.
Goals: ITL p90 ratio <= 0.5, TTFT p50 ratio <= 1.3, throughput ratio >= 0.9. Disaggregation "pays off" at a rate
when its ITL p90 is lower and the TTFT and throughput goals hold; the report names the rates where it pays off,
the first higher rate where it stops (`stops_paying_off_at_rate`, null if none) and the conditional rule's
decisions there (else at the top rate). Prints a table per rate and one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from harness.disagg import (  # noqa: E402
    BLOCK_TOKENS,
    ITL_GOAL,
    THROUGHPUT_GOAL,
    TTFT_GOAL,
    Request,
    build_workload,
    compare,
    disagg_metrics,
    stop_rate,
)
from harness.load import StreamTiming, drive, summarize  # noqa: E402
from harness.metrics import scrape  # noqa: E402
from harness.servers import MODEL_CACHE, smollm2_repository, start_strata, use_run_secret  # noqa: E402
from harness.stats import percentile  # noqa: E402
from harness.trace import add_trace_flags  # noqa: E402
from kvbm.host_pool import remove_segments  # noqa: E402

CONFIGS = ("aggregated", "disaggregated")
VLLM_CONFIGS = ("vllm-aggregated", "vllm-disaggregated")


def server_flags(config: str, args: argparse.Namespace, cache_id: str) -> list[str]:
    tiers = ["--no-kvbm"]
    if config.startswith("vllm-"):
        config = config.removeprefix("vllm-")
        tiers = ["--vllm-python", args.vllm_python, "--kvbm-host-cache-gb", "1", "--kvbm-cache-id", cache_id]
    if config == "aggregated":
        return ["--workers", "2", *tiers]
    return [
        "--prefill-workers", "1",
        "--decode-workers", "1",
        "--max-local-prefill-length", str(args.max_local_prefill_length),
        "--max-prefill-queue-size", str(args.max_prefill_queue_size),
        *tiers,
    ]  # fmt: skip


def vllm_repository(root: Path) -> Path:
    """One Triton vLLM-backend model named smollm2 (what the client asks for); the flags say its workers."""
    from server.engine.config import DEFAULT_MODEL
    from server.engine.loader import prepare_model

    model = root / "repository" / "smollm2"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('backend: "vllm"\n')
    engine_args = {
        "model": str(prepare_model(DEFAULT_MODEL).folder), "dtype": "float32", "max_model_len": 4096,
        "block_size": 64, "kv_cache_memory_bytes": 256 << 20, "max_num_batched_tokens": 1024,
    }  # fmt: skip
    (model / "1" / "model.json").write_text(json.dumps(engine_args, indent=2))
    return root / "repository"


def latency_summary(timings: list[StreamTiming], requests: list[Request]) -> dict[str, Any]:
    """harness.load.summarize, plus ITL p90/p99 (ms), TTFT by kind (s), the long prompts' first gap (ms) and
    tokens per chunk gap."""
    result = summarize(timings)
    ok = [(t, r) for t, r in zip(timings, requests, strict=True) if t.error is None and t.first_token]
    gaps = [b - a for t, _ in ok for a, b in itertools.pairwise(t.chunk_times)]
    for q in (50, 90, 99):
        result[f"itl_p{q}_ms"] = round(percentile(gaps, q) * 1000, 1)
    token_gaps = sum(max(0, t.completion_tokens - 1) for t, _ in ok)
    result["tokens_per_chunk"] = round(token_gaps / max(1, len(gaps)), 2)
    for kind, long in (("short", False), ("long", True)):
        ttft = [t.first_token - t.submitted for t, r in ok if r.long == long]
        result[f"ttft_p50_{kind}_s"] = round(percentile(ttft, 50), 3)
    first_gaps = [t.chunk_times[1] - t.chunk_times[0] for t, r in ok if r.long and len(t.chunk_times) > 1]
    result["long_first_gap_p50_ms"] = round(percentile(first_gaps, 50) * 1000, 1)
    result["makespan_s"] = round(max(t.finished for t in timings) - min(t.submitted for t in timings), 1)
    return result


def run_one(config: str, rate: float, requests: list[Request], args: argparse.Namespace) -> dict[str, Any]:
    """One fresh server of `config` driven by `requests` at `rate`; its summary and /metrics figures."""
    schedule = [(r.arrival_s / rate, r.prompt, r.max_tokens) for r in requests]
    with tempfile.TemporaryDirectory(prefix="strata-disagg-") as tmp:
        root = Path(tmp)
        flags = server_flags(config, args, root.name)
        if config.startswith("vllm-"):  # one unbound OpenMP thread per vLLM worker, as Strata's workers
            saved = {key: os.environ.get(key) for key in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")}
            os.environ.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
            try:
                server = start_strata(vllm_repository(root), root, *flags, ready_timeout_s=900)
            finally:
                for key, value in saved.items():
                    os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        else:
            repository = smollm2_repository(
                root,
                block_size=BLOCK_TOKENS,
                num_kv_blocks=args.kv_blocks,
                num_threads=1,
                cache_dir=args.model_cache,
                max_num_batched_tokens=args.max_num_batched_tokens,
            )
            server = start_strata(repository, root, *flags)
        url = server.openai_url
        try:
            timings = drive(url, schedule)  # already at its rate: no compression
            result = latency_summary(timings, requests)
            result |= disagg_metrics(scrape(url))
        except Exception:
            print(f"{config} server log tail:\n{server.log()[-4000:]}", file=sys.stderr)
            raise
        finally:
            server.stop()
            remove_segments(root.name)
        if args.keep_logs:
            Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
            (Path(args.keep_logs) / f"{config}-{rate:g}.log").write_text(server.log())
    return result


def bench(args: argparse.Namespace) -> dict[str, Any]:
    rates = sorted(float(r) for r in args.rates.split(","))
    configs = args.configs.split(",")
    counts = {rate: args.requests or max(1, round(rate * args.duration_s)) for rate in rates}
    workload = build_workload(args, max(counts.values()))
    runs = []
    for rate in rates:
        requests = workload[: counts[rate]]
        row: dict[str, Any] = {
            "rate": rate,
            "requests": len(requests),
            "long_requests": sum(r.long for r in requests),
            "arrival_span_s": round(requests[-1].arrival_s / rate, 1),
        }
        for config in configs:
            row[config] = run_one(config, rate, requests, args)
            print(f"rate {rate:g} {config}: {row[config]}", file=sys.stderr, flush=True)
        if set(CONFIGS) <= set(configs):
            row["comparison"] = compare(row["aggregated"], row["disaggregated"])
        if set(VLLM_CONFIGS) <= set(configs):
            row["vllm_comparison"] = compare(row["vllm-aggregated"], row["vllm-disaggregated"])
        runs.append(row)
    paying = [row["rate"] for row in runs if row.get("comparison", {}).get("pays_off")]
    return {
        "bench": "disagg",
        "scale": scale_note(args),
        "runs": runs,
        "pays_off_at_rates": paying,
        "stops_paying_off_at_rate": stop_rate(runs),
    }


def scale_note(args: argparse.Namespace) -> str:
    return (
        f"SmolLM2-135M fp32, 2 worker processes x 1 torch thread, {args.kv_blocks} KV blocks of "
        f"{BLOCK_TOKENS} tokens each, step budget {args.max_num_batched_tokens} tokens, G1 only; "
        f"Poisson arrivals, {args.long_share:.0%} long prompts of {args.long_min_tokens}-{args.long_max_tokens} "
        f"unique tokens ({args.long_output} output tokens), the rest Mooncake conversation turns "
        f"(>= {args.min_turns} turns; 1 hash id = 16 tokens, <= {args.short_max_blocks} blocks; "
        f"{args.short_min_output}-{args.short_max_output} output tokens); seed {args.seed}; disaggregated: "
        f"--max-local-prefill-length {args.max_local_prefill_length} "
        f"--max-prefill-queue-size {args.max_prefill_queue_size}"
        + (
            "; vllm-*: vLLM's engine, 2 workers x 1 OpenMP thread, 256 MiB of KV each in blocks of 64 tokens, "
            "step budget 1024 tokens, the node's G2 of 1 GiB below both (the handoff's path)"
            if any(c.startswith("vllm-") for c in args.configs.split(","))
            else ""
        )
    )


def print_report(report: dict[str, Any]) -> None:
    print(f"disaggregated vs aggregated: {report['scale']}")
    rows = (
        ("TTFT p50 s", "ttft_p50_s"),
        ("TTFT p90 s", "ttft_p90_s"),
        ("TTFT p50 short s", "ttft_p50_short_s"),
        ("TTFT p50 long s", "ttft_p50_long_s"),
        ("long 1st gap p50 ms", "long_first_gap_p50_ms"),
        ("ITL p50 ms", "itl_p50_ms"),
        ("ITL p90 ms", "itl_p90_ms"),
        ("ITL p99 ms", "itl_p99_ms"),
        ("tok/chunk", "tokens_per_chunk"),
        ("output tok/s", "throughput_tok_s"),
        ("makespan s", "makespan_s"),
        ("errors", "errors"),
    )
    for run in report["runs"]:
        configs = [c for c in (*CONFIGS, *VLLM_CONFIGS) if c in run]
        print(
            f"\n### rate {run['rate']:g} req/s: {run['requests']} requests ({run['long_requests']} long) "
            f"over {run['arrival_span_s']:g} s"
        )
        print("| metric | " + " | ".join(configs) + " |")
        print("|---" * (len(configs) + 1) + "|")
        for label, key in rows:
            print(f"| {label} | " + " | ".join(f"{run[c][key]:g}" for c in configs) + " |")
        for name in ("disaggregated", "vllm-disaggregated"):
            if name in run:
                print_disagg_rows(run[name], configs, name)
        for key, label in (("comparison", "disagg/agg"), ("vllm_comparison", "vLLM disagg/agg")):
            if key not in run:
                continue
            comparison = run[key]
            ratios, goals = comparison["ratios"], comparison["goals_met"]
            print(
                f"{label}: ITL p90 {ratios['itl_p90']:.2f}x (goal <= {ITL_GOAL}: "
                f"{'met' if goals['itl_p90'] else 'missed'}), TTFT p50 {ratios['ttft_p50']:.2f}x (goal <= "
                f"{TTFT_GOAL}: {'met' if goals['ttft_p50'] else 'missed'}), throughput {ratios['throughput']:.2f}x "
                f"(goal >= {THROUGHPUT_GOAL}: {'met' if goals['throughput'] else 'missed'}); "
                f"pays off: {'yes' if comparison['pays_off'] else 'no'}"
            )
    compared = [run for run in report["runs"] if "comparison" in run]
    if not compared:
        return
    paying, stops = report["pays_off_at_rates"], report["stops_paying_off_at_rate"]
    if not paying:
        verdict = "pays off at no swept rate"
    else:
        verdict = f"pays off at {', '.join(f'{rate:g}' for rate in paying)} req/s" + (
            f" and stops at {stops:g} req/s" if stops is not None else ", still at the highest rate"
        )
    last = next((run for run in compared if run["rate"] == stops), compared[-1])
    print(
        f"\ndisaggregation {verdict}; the rule's prefills at {last['rate']:g} req/s: "
        f"{last['disaggregated']['prefills']}"
    )


def print_disagg_rows(result: dict[str, Any], configs: list[str], column: str) -> None:
    """The rule's decisions and the transfer rate, in the disaggregated column ("-" in the others)."""
    prefills = ", ".join(f"{k} {v}" for k, v in sorted(result["prefills"].items())) or "none"
    gb_s = ", ".join(f"{side} {v:g}" for side, v in sorted(result["transfer_gb_s"].items())) or "none"
    for label, value in (
        ("prefills (where/reason)", prefills),
        ("KV transfer GB/s", f"{gb_s} ({result['transfer_gb']:g} GB)"),
    ):
        cells = [value if config == column else "-" for config in configs]
        print(f"| {label} | " + " | ".join(cells) + " |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="0.25,0.5,0.75,1", help="request rates to sweep, requests/s")
    parser.add_argument(
        "--duration-s", type=float, default=80.0, help="arrival span per run: rate x this requests"
    )
    parser.add_argument(
        "--requests", type=int, default=0, help="requests per run at every rate (0: rate x duration)"
    )
    parser.add_argument("--configs", default=",".join(CONFIGS), help="run in this order, fresh server each")
    parser.add_argument("--max-local-prefill-length", type=int, default=512, help="tokens (disaggregated)")
    parser.add_argument("--max-prefill-queue-size", type=int, default=4, help="remote prefills in flight")
    parser.add_argument(
        "--long-share", type=float, default=0.2, help="share of arrivals that are long prompts"
    )
    parser.add_argument("--long-min-tokens", type=int, default=1024)
    parser.add_argument("--long-max-tokens", type=int, default=2048)
    parser.add_argument("--long-output", type=int, default=8, help="output tokens of a long prompt")
    add_trace_flags(parser, conversations=64, min_turns=2)  # of the short turns
    parser.add_argument(
        "--short-max-blocks", type=int, default=4, help="16-token blocks kept of a short prompt"
    )
    parser.add_argument("--short-min-output", type=int, default=32)
    parser.add_argument("--short-max-output", type=int, default=64)
    parser.add_argument("--kv-blocks", type=int, default=1024, help="G1 pool per worker, blocks")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024, help="engine step budget, tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-logs", default="", help="directory for each run's server log")
    parser.add_argument("--model-cache", default=str(MODEL_CACHE))
    parser.add_argument("--quick", action="store_true", help="smoke run: one rate (0.5 req/s), 40 s")
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("STRATA_VLLM_PYTHON"),
        help="a venv with vLLM (make vllm): allows the vllm-* configurations",
    )
    args = parser.parse_args()
    if any(c.startswith("vllm-") for c in args.configs.split(",")) and not args.vllm_python:
        parser.error("the vllm-* configurations need --vllm-python (or STRATA_VLLM_PYTHON)")
    if args.quick:
        args.rates, args.duration_s = "0.5", 40.0  # 20 requests, 3 of them long (seed 0)
    return args


def main() -> None:
    args = parse_args()
    use_run_secret()
    report = bench(args)
    print_report(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
