"""A slice of the Mooncake trace against `strata serve --workers N`, driven over the OpenAI API exactly as a client
would (streamed /v1/completions with token-id prompts).

    python bench/routing_replay_serve.py [--conversations 12] [--workers 2] [--tiers g1,g2] [--duration-s 120]
                                         [--repeats 1] [--strategies kv-aware,round-robin] [--keep-logs DIR]

For each tier setting (`--tiers g1,g2`: G1-only prefix caching, or G1 + the node's shared G2 host pool) and each
routing strategy, a fresh server starts (harness.servers.start_strata: free ports, wait for readiness, SIGTERM at
the end) from a private copy of the example repository (model.json rewritten with the KV pool, block size and
threads below), the requests arrive at their trace times compressed to `--duration-s`, and the server is stopped.
Fresh servers keep one run's cache from helping the next.

Per run: TTFT p50/p90 (submit -> first streamed token), ITL p50 (gaps between streamed chunks of one request),
throughput (output tokens / time from first submit to last finish), prefix-hit rate (the usage's
`prompt_tokens_details.cached_tokens` / prompt tokens), errors, and the router's decision counts from /metrics;
and where the oracle's hits were lost (`hit_losses`): by whether the request holding the prefix had produced its
first token, or finished, when the request that missed it was sent. `--keep-logs DIR` keeps each server's router
decision log and per-request timings; `--repeats N` runs N rounds of every strategy and tier and reports medians
(these machines are noisy). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from harness.load import StreamTiming, drive, summarize  # noqa: E402
from harness.metrics import samples, scrape  # noqa: E402
from harness.servers import MODEL_CACHE, smollm2_repository, start_strata, use_run_secret  # noqa: E402
from harness.trace import add_trace_flags, trace_prompts  # noqa: E402
from kvbm.host_pool import remove_segments  # noqa: E402

_RUNS = itertools.count()  # numbers each run's G2 segment


def router_decisions(url: str) -> dict[str, int]:
    """strata_router_decisions_total by strategy/reason, from the frontend's /metrics."""
    return {
        f"{labels.get('strategy')}/{labels.get('reason')}": int(value)
        for labels, value in samples(scrape(url), "strata_router_decisions_total")
    }


def hit_losses(
    timings: list[StreamTiming], sources: list[tuple[int, int]], block_tokens: int
) -> dict[str, float]:
    """Where the oracle's hits were lost, as shares of all prompt tokens.

    For each request, the oracle's hit (capped as the engine caps it: the last prompt token is always computed)
    minus the cached tokens it got, filed by the state of its source request (the latest earlier one holding the
    hit prefix) when it was sent: still before its first token (`queued`: its prefix not yet computed anywhere),
    decoding, or finished. `ceiling` is the capped oracle itself: the hit rate an engine could reach.
    """
    lost = {"queued": 0, "decoding": 0, "finished": 0}
    ceiling = prompt = 0
    for timing, (hits, source) in zip(timings, sources, strict=True):
        if timing.error is not None:
            continue
        expected = min(hits, (timing.prompt_tokens - 1) // block_tokens) * block_tokens
        ceiling += expected
        prompt += timing.prompt_tokens
        if expected <= timing.cached_tokens or source < 0:
            continue
        before = timings[source]
        state = (
            "queued"
            if before.first_token is None or before.first_token > timing.submitted
            else "decoding"
            if before.finished is None or before.finished > timing.submitted
            else "finished"
        )
        lost[state] += expected - timing.cached_tokens
    prompt = max(1, prompt)
    return {"ceiling": round(ceiling / prompt, 4)} | {
        f"lost_{k}": round(v / prompt, 4) for k, v in lost.items()
    }


def server_flags(strategy: str, tier: str, args: argparse.Namespace, cache_id: str) -> list[str]:
    """`strata serve` flags of one run: `strategy` (kv-aware@4: --router-overlap-weight 4; kv-aware-in-flight:
    --router-count-in-flight) and `tier` (g1: --no-kvbm; g2: a fresh G2 segment named `cache_id`)."""
    name, _, weight = strategy.partition("@")
    flags = ["--workers", str(args.workers)] + (["--router-overlap-weight", weight] if weight else [])
    if name == "kv-aware-in-flight":  # kv-aware, counting in-flight requests' blocks as held
        flags += ["--routing-strategy", "kv-aware", "--router-count-in-flight"]
    else:
        flags += ["--routing-strategy", name]
    if tier == "g1":
        flags.append("--no-kvbm")
    else:  # G2: the node's shared host pool, a fresh segment per run (a reused one would start warm)
        flags += ["--kvbm-host-cache-gb", str(args.host_cache_gb), "--kvbm-cache-id", cache_id]
    if args.keep_logs:
        flags += ["--log-verbose", "1"]  # the router's per-decision debug lines
    return flags


def run_one(
    prompts: list[tuple[float, list[int], int]],
    sources: list[tuple[int, int]],
    strategy: str,
    tier: str,
    args: argparse.Namespace,
    log_name: str,
) -> dict[str, Any]:
    """One fresh `strata serve` replaying the slice; with --keep-logs its logs go to `log_name` in that
    directory."""
    cache_id = f"replay-{os.getpid()}-{next(_RUNS)}"
    with tempfile.TemporaryDirectory(prefix="strata-replay-") as tmp:
        root = Path(tmp)
        repository = smollm2_repository(
            root,
            block_size=args.block_tokens,
            num_kv_blocks=args.kv_blocks,
            num_threads=args.threads_per_worker,
            cache_dir=args.model_cache,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        server = start_strata(repository, root, *server_flags(strategy, tier, args, cache_id))
        try:
            timings = drive(server.openai_url, prompts, args.duration_s)
            result = summarize(timings) | hit_losses(timings, sources, args.block_tokens)
            result["decisions"] = router_decisions(server.openai_url)
        finally:
            server.stop()
            if tier != "g1":
                remove_segments(cache_id)
            if args.keep_logs:
                keep_logs(Path(args.keep_logs) / log_name, server.log_path, timings, sources)
    return result


def keep_logs(
    stem: Path, server_log: Path, timings: list[StreamTiming], sources: list[tuple[int, int]]
) -> None:
    """`<stem>.log`: the server's log (the router's decision lines); `<stem>.requests.jsonl`: one line a request."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(server_log, stem.with_name(stem.name + ".log"))
    rows = (
        {
            "id": t.response_id,
            "submitted": t.submitted,
            "first_token": t.first_token,
            "finished": t.finished,
            "prompt_tokens": t.prompt_tokens,
            "cached_tokens": t.cached_tokens,
            "oracle_blocks": hits,
            "source": source,
        }
        for t, (hits, source) in zip(timings, sources, strict=True)
    )
    stem.with_name(stem.name + ".requests.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def replay_serve_command(args: argparse.Namespace) -> dict:
    prompts, oracle, sources = trace_prompts(args)
    runs: dict[str, list[dict]] = {}
    for round_ in range(
        args.repeats
    ):  # rounds interleave the strategies: drift in the machine hits all alike
        for tier in args.tiers.split(","):
            for strategy in args.strategies.split(","):
                key = f"{strategy}/{tier}"
                log_name = f"{strategy}-{tier}" + (f"-r{round_}" if args.repeats > 1 else "")
                runs.setdefault(key, []).append(run_one(prompts, sources, strategy, tier, args, log_name))
                print(
                    f"{key} (round {round_ + 1}/{args.repeats}): {runs[key][-1]}", file=sys.stderr, flush=True
                )
    results = {key: median_run(rows) for key, rows in runs.items()}
    scale = (
        f"{len(prompts)} requests of {args.conversations} conversations (>= {args.min_turns} turns), 1 hash id = "
        f"{args.block_tokens} tokens (one KV block), <= {args.max_blocks} blocks a prompt, outputs <= "
        f"{args.max_output} tokens, trace compressed to {args.duration_s:g} s; `strata serve --workers "
        f"{args.workers}`, SmolLM2 fp32, {args.threads_per_worker} thread(s) and {args.kv_blocks} KV blocks "
        f"per worker; g2 = --kvbm-host-cache-gb {args.host_cache_gb:g}"
    )
    return {
        "bench": "routing_replay_serve",
        "scale": scale,
        "oracle_hit_rate": round(oracle, 3),
        "results": results,
    }


def median_run(rows: list[dict]) -> dict:
    """The median of each figure over repeated runs, and each run's hit rate and TTFT p50 (`runs`)."""
    if len(rows) == 1:
        return rows[0]
    numbers = [name for name, value in rows[0].items() if isinstance(value, int | float)]
    merged = {name: round(statistics.median(row[name] for row in rows), 4) for name in numbers}
    merged["runs"] = [{"hit_rate": row["hit_rate"], "ttft_p50_s": row["ttft_p50_s"]} for row in rows]
    merged["first_errors"] = [error for row in rows for error in row["first_errors"]][:3]
    return merged


def print_replay_serve_table(report: dict) -> None:
    print(f"replay through strata serve: {report['scale']}")
    print(f"oracle prefix hit rate (unlimited cache, this subset): {report['oracle_hit_rate']:.1%}")
    print(
        f"{'strategy/tiers':<22}{'hit rate':>9}{'TTFT p50 s':>11}{'p90 s':>8}{'ITL p50 ms':>11}{'tok/s':>8}"
        f"{'errors':>7}   lost to the oracle (ceiling): queued/decoding/finished source"
    )
    for name, row in report["results"].items():
        print(
            f"{name:<22}{row['hit_rate']:>9.1%}{row['ttft_p50_s']:>11.2f}{row['ttft_p90_s']:>8.2f}"
            f"{row['itl_p50_ms']:>11.1f}{row['throughput_tok_s']:>8.1f}{row['errors']:>7}   ({row['ceiling']:.1%}) "
            f"{row['lost_queued']:.1%}/{row['lost_decoding']:.1%}/{row['lost_finished']:.1%}"
        )
    rows = report["results"]
    for tier in sorted({name.split("/")[1].split("#")[0] for name in rows}):
        rr = rows.get(f"round-robin/{tier}")
        for kv_name in sorted({name.split("/")[0] for name in rows if name.startswith("kv-aware")}):
            kv = rows.get(f"{kv_name}/{tier}")
            if kv and rr and kv["ttft_p50_s"] > 0:
                print(
                    f"{tier}: round-robin / {kv_name} TTFT p50 = {rr['ttft_p50_s'] / kv['ttft_p50_s']:.2f}x"
                )
            if (
                kv and rr and "runs" in kv
            ):  # each round's own ratio: the two ran minutes apart, under like noise
                paired = [
                    a["ttft_p50_s"] / b["ttft_p50_s"] for a, b in zip(rr["runs"], kv["runs"], strict=True)
                ]
                hits = [f"{run['hit_rate']:.1%}" for run in kv["runs"]]
                print(
                    f"{tier}: {kv_name} per round: hit rate {', '.join(hits)}; TTFT p50 ratio "
                    f"{', '.join(f'{ratio:.2f}x' for ratio in paired)}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_trace_flags(
        parser, conversations=12, min_turns=3, max_output=16, max_blocks=48, block_tokens=16, duration_s=120.0
    )
    parser.add_argument("--kv-blocks", type=int, default=600, help="G1 pool per worker, blocks")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--tiers", default="g1,g2", help="g1: --no-kvbm; g2: G1 + shared host pool")
    parser.add_argument("--host-cache-gb", type=float, default=1.0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every strategy and tier; the table shows medians, and each round's hit rate and TTFT ratio",
    )
    parser.add_argument(
        "--keep-logs",
        default="",
        help="directory for each run's server log (router decisions at DEBUG) and per-request timings, to see "
        "where hits were lost",
    )
    parser.add_argument(
        "--strategies",
        default="kv-aware,round-robin",
        help="run in this order; also kv-aware-in-flight (--router-count-in-flight); a suffix @W sets "
        "--router-overlap-weight W (kv-aware@4)",
    )
    parser.add_argument("--model-cache", default=str(MODEL_CACHE))
    args = parser.parse_args()
    use_run_secret()
    report = replay_serve_command(args)
    print_replay_serve_table(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
