"""The time `Router.route` takes (index lookup included) with a KVBM index holding a million block hashes.

    python bench/routing_decision.py [--index-blocks 1000000] [--workers 8] [--decisions 5000]

The index (`kvbm.index.KVIndex`) holds `--index-blocks` block hashes spread over the workers and tiers; each
request has 128 full blocks (2,048 tokens at 16 tokens per block), most sharing a leading run with an indexed
prompt. The baseline measured in the same run is round-robin (no lookup); "full-hit" requests are indexed prompts,
all 128 blocks held (the longest walk). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from harness.stats import summary_us  # noqa: E402
from kvbm.block_hash import BlockHash  # noqa: E402
from kvbm.events import G1, G2, G3, G4, TierEvent  # noqa: E402
from kvbm.index import KVIndex  # noqa: E402
from server.router.config import RouterConfig  # noqa: E402
from server.router.router import Router  # noqa: E402
from server.workers.protocol import WorkerId, WorkerStats  # noqa: E402

PROMPT_BLOCKS = 128


def build_index(
    num_blocks: int, num_workers: int, rng: random.Random
) -> tuple[KVIndex, list[list[BlockHash]]]:
    """`num_blocks` distinct hashes as prompts of PROMPT_BLOCKS blocks, each held by one or two workers."""
    index = KVIndex(max_workers=max(64, num_workers))
    prompts = []
    for _ in range(num_blocks // PROMPT_BLOCKS):
        prompt = [BlockHash(rng.getrandbits(64)) for _ in range(PROMPT_BLOCKS)]
        prompts.append(prompt)
        for worker in rng.sample(range(num_workers), rng.choice((1, 1, 2))):
            split = rng.randrange(PROMPT_BLOCKS)
            tier = rng.choice((G2, G3))
            index.publish(TierEvent(f"w{worker}", "stored", G1, tuple(prompt[:split])))
            index.publish(TierEvent(f"w{worker}", "stored", tier, tuple(prompt[split:])))
        if rng.random() < 0.1:
            index.publish(TierEvent("w0", "stored", G4, tuple(prompt[: PROMPT_BLOCKS // 2])))
    return index, prompts


def make_queries(prompts: list[list[BlockHash]], count: int, rng: random.Random) -> list[list[BlockHash]]:
    """80 % share a random leading run with an indexed prompt, 20 % are new."""
    queries = []
    for _ in range(count):
        shared = rng.randrange(PROMPT_BLOCKS) if rng.random() < 0.8 else 0
        head = rng.choice(prompts)[:shared]
        queries.append(head + [BlockHash(rng.getrandbits(64)) for _ in range(PROMPT_BLOCKS - shared)])
    return queries


def time_decisions(router: Router, queries: list[list[BlockHash]]) -> list[float]:
    """Seconds per `route` (each request released right away, so load stays comparable)."""
    samples = []
    for i, query in enumerate(queries):
        started = time.perf_counter()
        router.route(f"r{i}", query)
        samples.append(time.perf_counter() - started)
        router.release(f"r{i}")
    return samples


def time_queries(index: KVIndex, queries: list[list[BlockHash]]) -> list[float]:
    samples = []
    for query in queries:
        started = time.perf_counter()
        index.query(query)
        samples.append(time.perf_counter() - started)
    return samples


def decision_bench(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    started = time.perf_counter()
    index, prompts = build_index(args.index_blocks, args.workers, rng)
    build_s = time.perf_counter() - started
    queries = make_queries(prompts, args.decisions, rng)
    routers = {
        name: Router(RouterConfig(strategy=name, lookup_budget_s=1.0), index)  # type: ignore[arg-type]
        for name in ("kv-aware", "round-robin")
    }
    for router in routers.values():
        for w in range(args.workers):
            router.update_worker(
                WorkerStats(
                    WorkerId(f"w{w}"),
                    kv_capacity_blocks=100_000,
                    prefill_tok_s=2000 + 100 * w,
                    decode_tok_s=50 + w,
                )
            )
    gc.collect()
    gc.freeze()  # the index's million entries would otherwise make each full collection a latency spike
    results = {"index_query": summary_us(time_queries(index, queries))}
    for name, router in routers.items():
        time_decisions(router, queries[:200])  # warm-up
        results[name] = summary_us(time_decisions(router, queries))
    full_hits = [rng.choice(prompts) for _ in range(args.decisions)]  # every block indexed: the longest walk
    results["kv-aware full-hit"] = summary_us(time_decisions(routers["kv-aware"], full_hits))
    return {
        "bench": "routing_decision",
        "index_blocks": len(index),
        "workers": args.workers,
        "prompt_blocks": PROMPT_BLOCKS,
        "decisions": args.decisions,
        "index_build_s": round(build_s, 1),
        "results": results,
    }


def print_table(report: dict) -> None:
    print(
        f"router decision time: {report['index_blocks']:,} indexed blocks, {report['workers']} workers, "
        f"{report['prompt_blocks']}-block requests, {report['decisions']} decisions"
    )
    print(f"{'path':<20}{'p50 us':>10}{'p90 us':>10}{'p99 us':>10}{'mean us':>10}")
    for name, row in report["results"].items():
        print(f"{name:<20}{row['p50_us']:>10}{row['p90_us']:>10}{row['p99_us']:>10}{row['mean_us']:>10}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--index-blocks", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--decisions", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    report = decision_bench(parser.parse_args())
    print_table(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
