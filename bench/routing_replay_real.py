"""A small slice of the Mooncake trace through `RoutedEngine` over real SmolLM2 worker processes (their KVBM events
feed the router's index), kv-aware against round-robin, fresh workers for each; minutes of CPU.

    python bench/routing_replay_real.py [--conversations 6] [--workers 2] [--duration-s 90]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from harness.servers import MODEL_CACHE  # noqa: E402
from harness.stats import percentile  # noqa: E402
from harness.trace import (  # noqa: E402
    TraceRequest,
    add_trace_flags,
    compression,
    load_conversations,
    oracle_hit_rate,
    prompt_tokens,
)
from kvbm.block_hash import BlockHash  # noqa: E402
from kvbm.index import KVIndex  # noqa: E402
from server.engine.api import GenerationOutput, GenerationRequest, RequestId, SamplingParams  # noqa: E402
from server.router.config import RouterConfig  # noqa: E402
from server.router.router import Router  # noqa: E402
from server.workers.protocol import WorkerId  # noqa: E402


@dataclass(slots=True)
class _Timing:
    submitted: float
    first_token: float | None = None
    output: GenerationOutput | None = None


def _replay_real_once(
    requests: list[TraceRequest], strategy: str, args: argparse.Namespace
) -> dict[str, Any]:
    from server.engine.config import EngineConfig
    from server.router.routed import RoutedEngine
    from server.workers.remote import spawn_workers
    from server.workers.worker import WorkerSpec, build_llm_engine

    engine_config = EngineConfig(
        cache_dir=args.model_cache,
        dtype="float32",
        device="cpu",
        block_size=args.block_tokens,
        num_kv_blocks=args.kv_blocks,
        max_model_len=4096,
        max_tokens_limit=64,
        num_threads=args.threads_per_worker,
        model_name="smollm2",
    )
    index = KVIndex()
    router = Router(RouterConfig(strategy=strategy), index)  # type: ignore[arg-type]
    spec = WorkerSpec(build_llm_engine, (engine_config, None), forward_events=True)
    workers = spawn_workers([WorkerId(f"w{i}") for i in range(args.workers)], spec, event_sink=index)
    try:
        routed = RoutedEngine(
            workers,
            router,
            workers[0].info.block_size or args.block_tokens,
            BlockHash(workers[0].info.salt or 0),
        )
        timings = _drive(routed, requests, args)
    finally:
        for worker in workers:
            worker.close()
    return _real_summary(timings, router)


def _drive(routed: Any, requests: list[TraceRequest], args: argparse.Namespace) -> dict[str, _Timing]:
    """Submit each request at its compressed arrival time; wait until every one has finished."""
    speedup = compression(requests[-1].arrival_s, args.duration_s)
    timings: dict[str, _Timing] = {}
    done = threading.Semaphore(0)

    def sink_for(request_id: str) -> Any:
        def sink(output: GenerationOutput) -> None:
            timing = timings[request_id]
            if timing.first_token is None and (output.new_token_ids or output.finished):
                timing.first_token = time.perf_counter()
            if output.finished:
                timing.output = output
                done.release()

        return sink

    started = time.perf_counter()
    for i, request in enumerate(requests):
        delay = started + request.arrival_s / speedup - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        prompt = prompt_tokens(request.hash_ids, args.block_tokens)
        request_id = f"r{i}"
        timings[request_id] = _Timing(time.perf_counter())
        sampling = SamplingParams(max_tokens=max(1, request.output_tokens), temperature=0.0, ignore_eos=True)
        routed.submit(GenerationRequest(RequestId(request_id), prompt, sampling), sink_for(request_id))
    for _ in requests:
        if not done.acquire(timeout=600):
            raise TimeoutError("replay-real: a request did not finish within 600 s")
    return timings


def _real_summary(timings: dict[str, _Timing], router: Router) -> dict[str, Any]:
    outputs = [t.output for t in timings.values() if t.output is not None]
    ttft = [t.first_token - t.submitted for t in timings.values() if t.first_token is not None]
    prompt = sum(o.num_prompt_tokens for o in outputs)
    decisions = {
        f"{s.labels['strategy']}/{s.labels['reason']}": int(s.value)
        for s in router.metrics.decisions.collect()[0].samples
        if s.name.endswith("_total")
    }
    return {
        "hit_rate": round(sum(o.num_cached_tokens for o in outputs) / max(1, prompt), 4),
        "ttft_p50_s": round(percentile(ttft, 50), 3),
        "ttft_p90_s": round(percentile(ttft, 90), 3),
        "ttft_mean_s": round(statistics.fmean(ttft), 3),
        "errors": sum(o.finish_reason == "error" for o in outputs),
        "decisions": decisions,
    }


def replay_real_command(args: argparse.Namespace) -> dict:
    requests = load_conversations(args.conversations, args.min_turns, args.max_output, args.max_blocks)
    results = {}
    for run, strategy in enumerate(args.strategies.split(",")):
        key = strategy if strategy not in results else f"{strategy}#{run + 1}"
        results[key] = _replay_real_once(requests, strategy, args)
    scale = (
        f"{len(requests)} requests of {args.conversations} conversations, 1 hash id = {args.block_tokens} "
        f"tokens (one KV block), <= {args.max_blocks} blocks a prompt, outputs <= {args.max_output} tokens, "
        f"trace compressed to {args.duration_s:g} s, {args.workers} SmolLM2 fp32 workers x "
        f"{args.threads_per_worker} thread, {args.kv_blocks} KV blocks each"
    )
    return {
        "bench": "routing_replay_real",
        "scale": scale,
        "oracle_hit_rate": round(oracle_hit_rate(requests), 3),
        "results": results,
    }


def print_replay_real_table(report: dict) -> None:
    print(f"real replay: {report['scale']}")
    print(f"oracle prefix hit rate (unlimited cache, this subset): {report['oracle_hit_rate']:.1%}")
    print(f"{'strategy':<14}{'hit rate':>9}{'TTFT p50 s':>11}{'p90 s':>8}{'mean s':>8}{'errors':>8}")
    for name, row in report["results"].items():
        print(
            f"{name:<14}{row['hit_rate']:>9.1%}{row['ttft_p50_s']:>11.2f}{row['ttft_p90_s']:>8.2f}"
            f"{row['ttft_mean_s']:>8.2f}{row['errors']:>8}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_trace_flags(
        parser, conversations=6, min_turns=3, max_output=8, max_blocks=48, block_tokens=16, duration_s=90.0
    )
    parser.add_argument("--kv-blocks", type=int, default=600, help="G1 pool per worker, blocks")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument(
        "--strategies",
        default="kv-aware,round-robin",
        help="run in this order (machine noise drifts: compare both orders)",
    )
    parser.add_argument("--model-cache", default=str(MODEL_CACHE))
    report = replay_real_command(parser.parse_args())
    print_replay_real_table(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
