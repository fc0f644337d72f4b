"""The Mooncake conversation trace replayed through the real `Router` and the real KVBM index, against simulated
workers (`ReplayConfig` states the model and the scale).

    python bench/routing_replay.py [--conversations 48] [--workers 4] [--block-tokens 64] [--speedup 2] [--plot PNG]

Every strategy sees the same requests; round-robin is the baseline, the oracle hit rate (unlimited cache, same
subset) the bound. Prints a table and one JSON line.

What is simulated and what is measured: the workers' caches and clocks are a simulation with fixed speeds
(`ReplayConfig`), so hit rate, TTFT and load shares are simulated (`sim_*` in the JSON, "sim" in the table); only
the routing decision's time (`route_p50_us`) is measured, on this CPU.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from bench.machine import machine  # noqa: E402
from harness.stats import percentile  # noqa: E402
from harness.trace import TraceRequest, add_trace_flags, load_conversations, oracle_hit_rate  # noqa: E402
from kvbm.block_hash import BlockHash  # noqa: E402
from kvbm.events import G1, TierEvent  # noqa: E402
from kvbm.index import KVIndex  # noqa: E402
from server.router.config import RouterConfig  # noqa: E402
from server.router.router import Router  # noqa: E402
from server.workers.protocol import WorkerId, WorkerStats  # noqa: E402


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """The simulated cluster. Each worker prefills one request at a time (FIFO) at `prefill_tok_s`; blocks it
    holds in its G1 prefix cache (LRU, `g1_blocks`) restore `restore_speedup` times faster; decoding overlaps
    prefill and holds the request's blocks for output_tokens * `decode_s_per_token`. These speeds are fixed, not
    measured by the run; the defaults are SmolLM2-135M fp32 as once measured on a 2-core CPU (2,048-token
    prefill 4.1 s, decode 42 ms/token, cached prefix 24x faster).
    Workers publish stored/removed events to the KVBM index at once; the router sees only the index."""

    workers: int = 4
    block_tokens: int = 64
    speedup: float = 8.0
    g1_blocks: int = 512
    prefill_tok_s: float = 500.0
    restore_speedup: float = 24.0
    decode_s_per_token: float = 0.042

    def describe(self, num_requests: int, conversations: int) -> str:
        return (
            f"{num_requests} requests of {conversations} conversations, 1 hash id = {self.block_tokens} "
            f"tokens, time / {self.speedup:g}, {self.workers} workers x {self.g1_blocks} G1 blocks, "
            f"fixed simulated speeds: prefill {self.prefill_tok_s:g} tok/s, cached prefix "
            f"{self.restore_speedup:g}x faster, decode {self.decode_s_per_token * 1e3:g} ms/token"
        )


class SimWorker:
    def __init__(self, worker_id: str, capacity: int, index: KVIndex) -> None:
        self.worker_id = worker_id
        self.capacity = capacity
        self.index = index
        self.cache: OrderedDict[BlockHash, None] = OrderedDict()
        self.queue: deque[tuple[str, TraceRequest, list[BlockHash], float]] = deque()
        self.busy = False
        self.requests = 0

    def cached_prefix(self, hashes: list[BlockHash]) -> int:
        for position, block_hash in enumerate(hashes):
            if block_hash not in self.cache:
                return position
        return len(hashes)

    def store(self, hashes: list[BlockHash]) -> None:
        """Touch or insert the request's blocks; evict least recently used ones beyond capacity."""
        new = [h for h in hashes if h not in self.cache]
        for block_hash in hashes:
            self.cache[block_hash] = None
            self.cache.move_to_end(block_hash)
        evicted = []
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        if evicted:
            self.index.publish(TierEvent(self.worker_id, "removed", G1, tuple(evicted)))
        if new:
            self.index.publish(
                TierEvent(self.worker_id, "stored", G1, tuple(h for h in new if h in self.cache))
            )


class _Simulation:
    def __init__(self, config: ReplayConfig, router_config: RouterConfig) -> None:
        self.config = config
        self.index = KVIndex()
        self.router = Router(router_config, self.index)
        self.workers = {
            WorkerId(f"w{i}"): SimWorker(f"w{i}", config.g1_blocks, self.index) for i in range(config.workers)
        }
        for worker_id in self.workers:
            self.router.update_worker(WorkerStats(worker_id, kv_capacity_blocks=config.g1_blocks))
        self.events: list[tuple[float, int, str, Any]] = []
        self.sequence = 0
        self.ttfts: list[float] = []
        self.route_s: list[float] = []
        self.hit_blocks = self.total_blocks = 0

    def push(self, at: float, kind: str, payload: Any) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (at, self.sequence, kind, payload))

    def run(self, requests: list[TraceRequest]) -> None:
        for i, request in enumerate(requests):
            self.push(request.arrival_s / self.config.speedup, "arrive", (f"r{i}", request))
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            getattr(self, f"_{kind}")(now, payload)

    def _arrive(self, now: float, payload: tuple[str, TraceRequest]) -> None:
        request_id, request = payload
        hashes = [BlockHash(block_id + 1) for block_id in request.hash_ids]
        started = time.perf_counter()
        worker = self.workers[self.router.route(request_id, hashes).worker_id]
        self.route_s.append(time.perf_counter() - started)
        worker.queue.append((request_id, request, hashes, now))
        if not worker.busy:
            self._start_prefill(now, worker)

    def _start_prefill(self, now: float, worker: SimWorker) -> None:
        request_id, request, hashes, arrived = worker.queue.popleft()
        cached = worker.cached_prefix(hashes)
        tokens = self.config.block_tokens
        seconds = (
            (len(hashes) - cached) * tokens + cached * tokens / self.config.restore_speedup
        ) / self.config.prefill_tok_s
        worker.busy = True
        worker.requests += 1
        self.hit_blocks += cached
        self.total_blocks += len(hashes)
        self.push(now + seconds, "prefilled", (worker, request_id, request, hashes, arrived))

    def _prefilled(
        self, now: float, payload: tuple[SimWorker, str, TraceRequest, list[BlockHash], float]
    ) -> None:
        worker, request_id, request, hashes, arrived = payload
        self.ttfts.append(now - arrived)
        self.router.prefill_done(request_id)
        worker.store(hashes)
        worker.busy = False
        self.push(now + request.output_tokens * self.config.decode_s_per_token, "finish", request_id)
        if worker.queue:
            self._start_prefill(now, worker)

    def _finish(self, now: float, request_id: str) -> None:
        self.router.release(request_id)

    def summary(self) -> dict[str, float]:
        """sim_*: outcomes of the simulated workers (fixed speeds); route_p50_us: measured wall time of the real
        `Router.route` on this CPU."""
        shares = [w.requests / len(self.ttfts) for w in self.workers.values()]
        return {
            "sim_hit_rate": round(self.hit_blocks / self.total_blocks, 4),
            "sim_ttft_p50_s": round(percentile(self.ttfts, 50), 3),
            "sim_ttft_p90_s": round(percentile(self.ttfts, 90), 3),
            "sim_ttft_p99_s": round(percentile(self.ttfts, 99), 3),
            "sim_share_max": round(max(shares), 3),
            "sim_share_min": round(min(shares), 3),
            "route_p50_us": round(percentile(self.route_s, 50) * 1e6, 1),
        }


def simulate(
    requests: list[TraceRequest], config: ReplayConfig, router_config: RouterConfig
) -> dict[str, float]:
    simulation = _Simulation(config, router_config)
    simulation.run(requests)
    return simulation.summary()


def replay_command(args: argparse.Namespace) -> dict:
    requests = load_conversations(args.conversations, args.min_turns, args.max_output)
    config = ReplayConfig(
        workers=args.workers, block_tokens=args.block_tokens, speedup=args.speedup, g1_blocks=args.g1_blocks
    )
    results = {}
    for name, router_config in {
        "kv-aware": RouterConfig(strategy="kv-aware"),
        "kv-aware-t0.3": RouterConfig(strategy="kv-aware", temperature=0.3, seed=1),
        "least-loaded": RouterConfig(strategy="least-loaded"),
        "round-robin": RouterConfig(strategy="round-robin"),
        "random": RouterConfig(strategy="random", seed=1),
    }.items():
        results[name] = simulate(requests, config, router_config)
    return {
        "bench": "routing_replay",
        "scale": config.describe(len(requests), args.conversations),
        "simulated": True,  # every sim_* figure: simulated workers at ReplayConfig's fixed speeds, not measured
        "measured": ["route_p50_us"],  # the real Router's decision time on this machine
        "machine": machine(),
        "oracle_hit_rate": round(oracle_hit_rate(requests), 3),
        "results": results,
    }


def print_replay_table(report: dict) -> None:
    print(f"Mooncake replay, SIMULATED workers: {report['scale']}")
    print("sim = simulated at those fixed speeds, not measured; measured = the real Router on this CPU")
    print(f"oracle prefix hit rate (unlimited cache, this subset): {report['oracle_hit_rate']:.1%}")
    print(
        f"{'strategy':<15}{'sim hit rate':>13}{'sim TTFT p50 s':>15}{'sim p90 s':>10}{'sim p99 s':>10}"
        f"{'sim share max/min':>19}{'measured route p50 us':>23}"
    )
    for name, row in report["results"].items():
        print(
            f"{name:<15}{row['sim_hit_rate']:>13.1%}{row['sim_ttft_p50_s']:>15.2f}{row['sim_ttft_p90_s']:>10.2f}"
            f"{row['sim_ttft_p99_s']:>10.2f}{row['sim_share_max']:>12.1%}/{row['sim_share_min']:<6.1%}"
            f"{row['route_p50_us']:>23.1f}"
        )


def plot(report: dict, path: Path) -> None:
    """Simulated hit rate per strategy against the oracle's bound, and simulated TTFT p50/p90, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["results"])
    rows = [report["results"][name] for name in names]
    figure, (hits, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    hits.bar(names, [row["sim_hit_rate"] for row in rows], color="tab:blue")
    hits.axhline(report["oracle_hit_rate"], color="black", linestyle="--", linewidth=1, label="oracle")
    hits.set_ylabel("prefix hit rate, simulated")
    hits.set_ylim(0, 1)
    hits.legend(loc="upper right")
    positions = range(len(names))
    ttft.bar([x - 0.2 for x in positions], [row["sim_ttft_p50_s"] for row in rows], width=0.4, label="p50")
    ttft.bar([x + 0.2 for x in positions], [row["sim_ttft_p90_s"] for row in rows], width=0.4, label="p90")
    ttft.set_xticks(list(positions), names)
    ttft.set_ylabel("TTFT, s, simulated (fixed speeds)")
    ttft.legend(loc="upper left")
    for axis in (hits, ttft):
        axis.tick_params(axis="x", labelrotation=20)
    figure.suptitle(f"Mooncake replay, simulated workers: {report['scale']}", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_trace_flags(parser, conversations=48, min_turns=2, max_output=64, block_tokens=64)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--g1-blocks", type=int, default=1024, help="prefix-cache capacity per worker, blocks"
    )
    parser.add_argument("--speedup", type=float, default=2.0, help="trace time compression")
    parser.add_argument("--plot", type=Path, default=None, help="write the figure (PNG) here")
    args = parser.parse_args()
    report = replay_command(args)
    print_replay_table(report)
    print(json.dumps(report))
    if args.plot is not None:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
