"""KV-aware routing benchmarks.

    python bench/routing.py decision [--index-blocks 1000000] [--workers 8] [--decisions 5000]
    python bench/routing.py replay [--conversations 48] [--workers 4] [--block-tokens 64] [--speedup 4]
    python bench/routing.py replay-real [--conversations 10] [--workers 2] [--duration-s 60]
    python bench/routing.py replay-serve [--conversations 12] [--workers 2] [--tiers g1,g2] [--duration-s 120]
                                         [--repeats 1]
    python bench/routing.py transport [--round-trips 5000]

`decision`: the time `Router.route` takes (index lookup included) with a KVBM index (`kvbm.index.KVIndex`)
holding `--index-blocks` block hashes spread over the workers and tiers; each request has 128 full blocks
(2,048 tokens at 16 tokens per block), most sharing a leading run with an indexed prompt. The baseline measured in
the same run is round-robin (no lookup); "full-hit" requests are indexed prompts, all 128 blocks held (worst case).

`replay`: the Mooncake conversation trace (bench/data/mooncake) replayed through the real `Router` and the real
KVBM index, against simulated workers (`ReplayConfig` states the model and the scale). Every strategy
sees the same requests; round-robin is the baseline, the oracle hit rate (unlimited cache, same subset) the bound.

`replay-real`: a slice of the trace through `RoutedEngine` over real SmolLM2 worker processes (their KVBM events
feed the router's index), kv-aware against round-robin, fresh workers for each; minutes of CPU.

`replay-serve`: the same kind of slice against `strata serve --workers N` over the OpenAI API (serve_replay.py):
TTFT p50/p90, ITL p50, throughput and hit rate of each strategy with each tier setting, fresh server per run;
the oracle hits each run lost, by the state of the request holding the prefix when the one that missed was sent
(queued, decoding, finished); `--keep-logs DIR` keeps each server's router decision log and per-request timings;
`--repeats N` runs N rounds of every strategy and tier and reports medians (these machines are noisy).

`transport`: the worker link's two hot paths between two processes: a call's round trip (server -> worker submit,
worker -> server answer) and a stream of GenerationOutputs (worker -> server, one per token per request; "sender us"
is the engine thread's time per send). The worker channel with its typed msgspec messages, against the same ZMQ ipc
sockets carrying pickled tuples (the protocol before it) and multiprocessing.Pipe (the alternative ZMQ was chosen
over), in the same run.

Each command prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import multiprocessing
import pickle
import random
import statistics
import sys
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvbm.block_hash import BlockHash  # noqa: E402
from kvbm.events import G1, G2, G3, G4, TierEvent  # noqa: E402
from kvbm.index import KVIndex  # noqa: E402
from server.engine.api import GenerationOutput, GenerationRequest, RequestId, SamplingParams  # noqa: E402
from server.router.config import RouterConfig  # noqa: E402
from server.router.router import Router  # noqa: E402
from server.workers.protocol import Accepted, Codec, Out, Submit, ToServer, ToWorker, WorkerId, WorkerStats  # noqa: E402
from server.workers.transport import Channel, ChannelAddress  # noqa: E402

PROMPT_BLOCKS = 128
TRACE = Path(__file__).resolve().parent / "data" / "mooncake" / "conversation_trace.jsonl"


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


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6  # noqa: E731
    return {
        "p50_us": round(pick(0.5), 1),
        "p90_us": round(pick(0.9), 1),
        "p99_us": round(pick(0.99), 1),
        "mean_us": round(statistics.fmean(samples) * 1e6, 1),
    }


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
    results = {"index_query": summary(time_queries(index, queries))}
    for name, router in routers.items():
        time_decisions(router, queries[:200])  # warm-up
        results[name] = summary(time_decisions(router, queries))
    full_hits = [rng.choice(prompts) for _ in range(args.decisions)]  # every block indexed: the longest walk
    results["kv-aware full-hit"] = summary(time_decisions(routers["kv-aware"], full_hits))
    return {
        "bench": "routing.decision",
        "index_blocks": len(index),
        "workers": args.workers,
        "prompt_blocks": PROMPT_BLOCKS,
        "decisions": args.decisions,
        "index_build_s": round(build_s, 1),
        "results": results,
    }


def print_decision_table(report: dict) -> None:
    print(
        f"router decision time: {report['index_blocks']:,} indexed blocks, {report['workers']} workers, "
        f"{report['prompt_blocks']}-block requests, {report['decisions']} decisions"
    )
    print(f"{'path':<20}{'p50 us':>10}{'p90 us':>10}{'p99 us':>10}{'mean us':>10}")
    for name, row in report["results"].items():
        print(f"{name:<20}{row['p50_us']:>10}{row['p90_us']:>10}{row['p99_us']:>10}{row['mean_us']:>10}")


# ---- replay: the Mooncake trace through the router, against simulated workers ----


@dataclass(slots=True)
class TraceRequest:
    arrival_s: float  # trace time
    hash_ids: list[int]  # one per block; equal leading ids = equal prefix
    output_tokens: int


def _conversation(row: dict) -> int:
    """The second hash id names a conversation (the first, 0, is the shared system prompt); -1: none."""
    return row["hash_ids"][1] if len(row["hash_ids"]) > 1 else -1


def load_conversations(path: Path, conversations: int, min_turns: int, max_output: int) -> list[TraceRequest]:
    """All requests of the first `conversations` conversations having >= `min_turns` requests, in trace order."""
    rows = [json.loads(line) for line in path.open()]
    turns = Counter(_conversation(row) for row in rows)
    chosen: set[int] = set()
    for row in rows:
        conversation = _conversation(row)
        if conversation >= 0 and turns[conversation] >= min_turns and len(chosen) < conversations:
            chosen.add(conversation)
    return [
        TraceRequest(row["timestamp"] / 1000, row["hash_ids"], min(row["output_length"], max_output))
        for row in rows
        if _conversation(row) in chosen
    ]


def oracle_hit_rate(requests: list[TraceRequest]) -> float:
    """Share of blocks that are prefix hits with one unlimited cache (the bound for any router)."""
    seen: set[int] = set()
    hits = total = 0
    for request in requests:
        for block_id in request.hash_ids:
            if block_id not in seen:
                break
            hits += 1
        total += len(request.hash_ids)
        seen.update(request.hash_ids)
    return hits / total


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """The simulated cluster. Each worker prefills one request at a time (FIFO) at `prefill_tok_s`; blocks it
    holds in its G1 prefix cache (LRU, `g1_blocks`) restore `restore_speedup` times faster; decoding overlaps
    prefill and holds the request's blocks for output_tokens * `decode_s_per_token`. Defaults: SmolLM2-135M
    fp32 on these CPUs (brief: 2,048-token prefill 4.1 s, decode 42 ms/token, cached prefix 24x faster).
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
            f"prefill {self.prefill_tok_s:g} tok/s, decode {self.decode_s_per_token * 1e3:g} ms/token"
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
        shares = [w.requests / len(self.ttfts) for w in self.workers.values()]
        ttft = sorted(self.ttfts)
        pick = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]  # noqa: E731
        return {
            "hit_rate": round(self.hit_blocks / self.total_blocks, 4),
            "ttft_p50_s": round(pick(0.5), 3),
            "ttft_p90_s": round(pick(0.9), 3),
            "ttft_p99_s": round(pick(0.99), 3),
            "share_max": round(max(shares), 3),
            "share_min": round(min(shares), 3),
            "route_p50_us": round(sorted(self.route_s)[len(self.route_s) // 2] * 1e6, 1),
        }


def simulate(
    requests: list[TraceRequest], config: ReplayConfig, router_config: RouterConfig
) -> dict[str, float]:
    simulation = _Simulation(config, router_config)
    simulation.run(requests)
    return simulation.summary()


def replay_command(args: argparse.Namespace) -> dict:
    requests = load_conversations(TRACE, args.conversations, args.min_turns, args.max_output)
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
        "bench": "routing.replay",
        "scale": config.describe(len(requests), args.conversations),
        "oracle_hit_rate": round(oracle_hit_rate(requests), 3),
        "results": results,
    }


def print_replay_table(report: dict) -> None:
    print(f"Mooncake replay: {report['scale']}")
    print(f"oracle prefix hit rate (unlimited cache, this subset): {report['oracle_hit_rate']:.1%}")
    print(
        f"{'strategy':<15}{'hit rate':>9}{'TTFT p50 s':>11}{'p90 s':>8}{'p99 s':>8}"
        f"{'share max/min':>15}{'route p50 us':>14}"
    )
    for name, row in report["results"].items():
        print(
            f"{name:<15}{row['hit_rate']:>9.1%}{row['ttft_p50_s']:>11.2f}{row['ttft_p90_s']:>8.2f}"
            f"{row['ttft_p99_s']:>8.2f}{row['share_max']:>8.1%}/{row['share_min']:<6.1%}"
            f"{row['route_p50_us']:>14.1f}"
        )


# ---- replay-real: a small slice of the trace through RoutedEngine over real SmolLM2 worker processes ----


def _block_tokens(block_id: int, block_tokens: int) -> list[int]:
    """Deterministic token ids of one trace block (equal ids give equal tokens, so prefixes match)."""
    return [1000 + (block_id * 7919 + j * 104_729) % 40_000 for j in range(block_tokens)]


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
    speedup = max(1.0, requests[-1].arrival_s / args.duration_s)
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
        prompt = [
            t
            for block_id in request.hash_ids[: args.max_blocks]
            for t in _block_tokens(block_id, args.block_tokens)
        ]
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
    ttft = sorted(t.first_token - t.submitted for t in timings.values() if t.first_token is not None)
    pick = lambda q: round(ttft[min(len(ttft) - 1, int(q * len(ttft)))], 3)  # noqa: E731
    prompt = sum(o.num_prompt_tokens for o in outputs)
    decisions = {
        f"{s.labels['strategy']}/{s.labels['reason']}": int(s.value)
        for s in router.metrics.decisions.collect()[0].samples
        if s.name.endswith("_total")
    }
    return {
        "hit_rate": round(sum(o.num_cached_tokens for o in outputs) / max(1, prompt), 4),
        "ttft_p50_s": pick(0.5),
        "ttft_p90_s": pick(0.9),
        "ttft_mean_s": round(statistics.fmean(ttft), 3),
        "errors": sum(o.finish_reason == "error" for o in outputs),
        "decisions": decisions,
    }


def replay_real_command(args: argparse.Namespace) -> dict:
    requests = load_conversations(TRACE, args.conversations, args.min_turns, args.max_output)
    oracle = oracle_hit_rate(
        [TraceRequest(r.arrival_s, r.hash_ids[: args.max_blocks], r.output_tokens) for r in requests]
    )
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
        "bench": "routing.replay_real",
        "scale": scale,
        "oracle_hit_rate": round(oracle, 3),
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


def oracle_sources(requests: list[TraceRequest]) -> list[tuple[int, int]]:
    """Per request: (blocks the unlimited cache would hit, index of the latest earlier request holding the last of
    them, -1 with no hit) -- the request whose prefill must have finished, on the same worker, for the hit."""
    holder: dict[int, int] = {}  # block id -> latest request index containing it
    sources = []
    for i, request in enumerate(requests):
        hits = 0
        for block_id in request.hash_ids:
            if block_id not in holder:
                break
            hits += 1
        sources.append((hits, holder[request.hash_ids[hits - 1]] if hits else -1))
        holder.update((block_id, i) for block_id in request.hash_ids)
    return sources


def trace_prompts(
    args: argparse.Namespace,
) -> tuple[list[tuple[float, list[int], int]], float, list[tuple[int, int]]]:
    """(arrival_s, prompt token ids, max_tokens) of the chosen slice, its oracle hit rate and oracle sources."""
    requests = load_conversations(TRACE, args.conversations, args.min_turns, args.max_output)
    kept = [TraceRequest(r.arrival_s, r.hash_ids[: args.max_blocks], r.output_tokens) for r in requests]
    prompts = [
        (
            r.arrival_s,
            [t for block_id in r.hash_ids for t in _block_tokens(block_id, args.block_tokens)],
            max(1, r.output_tokens),
        )
        for r in kept
    ]
    return prompts, oracle_hit_rate(kept), oracle_sources(kept)


def replay_serve_command(args: argparse.Namespace) -> dict:
    from bench.serve_replay import run_one

    prompts, oracle, sources = trace_prompts(args)
    runs: dict[str, list[dict]] = {}
    for round_ in range(
        args.repeats
    ):  # rounds interleave the strategies, so drift in the machine hits all alike
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
        "bench": "routing.replay_serve",
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


# ---- transport: the worker channel (msgspec) against pickled tuples (ZMQ, as before) and multiprocessing.Pipe ----

_SAMPLE_OUTPUT = GenerationOutput(
    RequestId("0123456789abcdef0123456789abcdef-0"), [1234], " hello", False, None, 2048, 1024, 17
)
_SAMPLE_REQUEST = GenerationRequest(
    RequestId("0123456789abcdef0123456789abcdef-0"),
    list(range(2048)),
    SamplingParams(max_tokens=64, temperature=0.0),
)
_WARMUP_CALLS = 200


@dataclass(slots=True)
class _DataclassOutput:
    """GenerationOutput as it was when the link pickled it (a slots dataclass): what the pickle rows send."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    retryable: bool = False
    kv_handoff: None = None  # the fields GenerationOutput gained since, so both rows send the same content
    kv_transfer_us: int = 0
    kv_transfer_bytes: int = 0


@dataclass(slots=True)
class _DataclassSampling:
    """SamplingParams as it was (the fields a request sets here; the rest were defaults of the same kinds)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass(slots=True)
class _DataclassRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: _DataclassSampling


_PICKLED_OUTPUT = _DataclassOutput(*msgspec.structs.astuple(_SAMPLE_OUTPUT))
_PICKLED_REQUEST = _DataclassRequest(
    _SAMPLE_REQUEST.request_id,
    _SAMPLE_REQUEST.prompt_token_ids,
    _DataclassSampling(*msgspec.structs.astuple(_SAMPLE_REQUEST.sampling)),
)


class _TypedLink:
    """The worker channel as it is: msgspec Structs (server/workers/protocol.py)."""

    def __init__(self, address: ChannelAddress, server_side: bool) -> None:
        self.channel = Channel(address, server_side)

    def call(self, call_id: int) -> None:
        self.channel.send(Submit(call_id, _SAMPLE_REQUEST))

    def answer(self, call: Any) -> None:
        self.channel.send(Accepted(call.call_id))

    def send_output(self, output: GenerationOutput) -> None:
        self.channel.send(Out(output))

    def recv(self) -> Any:
        return self.channel.recv()

    def close(self) -> None:
        self.channel.close()


class _PickledLink:
    """The worker channel as it was: the same ZMQ PUSH/PULL ipc sockets and send lock, pickled tuples."""

    def __init__(self, address: ChannelAddress, server_side: bool) -> None:
        import zmq

        self._context = zmq.Context()
        self._out, self._in = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
        out_endpoint, in_endpoint = (
            (address.to_worker, address.to_server) if server_side else (address.to_server, address.to_worker)
        )
        for sock, endpoint in ((self._out, out_endpoint), (self._in, in_endpoint)):
            sock.setsockopt(zmq.LINGER, 0 if server_side else 2000)
            if server_side:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        self._lock = threading.Lock()

    def _send(self, *message: Any) -> None:
        with self._lock:
            self._out.send_pyobj(message)

    def call(self, call_id: int) -> None:
        self._send("call", call_id, "submit", (_PICKLED_REQUEST,))

    def answer(self, call: Any) -> None:
        self._send("reply", call[1], "ok", None)

    def send_output(self, output: GenerationOutput) -> None:
        self._send("out", _PICKLED_OUTPUT)

    def recv(self) -> Any:
        return self._in.recv_pyobj()

    def close(self) -> None:
        self._out.close()
        self._in.close()
        self._context.term()


class _PipeLink(_PickledLink):
    """multiprocessing.Pipe, pickled tuples."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection
        self._lock = threading.Lock()

    def _send(self, *message: Any) -> None:
        with self._lock:
            self._connection.send(message)

    def recv(self) -> Any:
        return self._connection.recv()

    def close(self) -> None:
        self._connection.close()


def _open_link(kind: str, endpoint: Any, server_side: bool) -> Any:
    if kind == "pipe":
        return _PipeLink(endpoint)
    return (_TypedLink if kind == "msgspec" else _PickledLink)(endpoint, server_side)


def _worker_side(kind: str, endpoint: Any, count: int, control: Any) -> None:
    """Answer the calls, then stream `count` outputs and report the time spent sending them (on `control`)."""
    link = _open_link(kind, endpoint, server_side=False)
    for _ in range(_WARMUP_CALLS + count):
        link.answer(link.recv())
    started = time.perf_counter()
    for _ in range(count):
        link.send_output(_SAMPLE_OUTPUT)
    control.send(time.perf_counter() - started)
    control.recv()  # the server side has read everything
    link.close()


def _measure_link(kind: str, count: int) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    control, child_control = context.Pipe()
    if kind == "pipe":
        endpoint, child_endpoint = context.Pipe()
    else:
        endpoint = child_endpoint = ChannelAddress.fresh()
    link = _open_link(kind, endpoint, server_side=True)  # binds first: the worker connects to it
    child = context.Process(target=_worker_side, args=(kind, child_endpoint, count, child_control))
    child.start()
    for call_id in range(_WARMUP_CALLS):
        link.call(call_id)
        link.recv()
    samples = []
    for call_id in range(count):
        started = time.perf_counter()
        link.call(call_id)
        link.recv()
        samples.append(time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(count):
        link.recv()
    elapsed = time.perf_counter() - started
    sender_s = control.recv()
    control.send("done")
    child.join()
    link.close()
    return {
        **summary(samples),
        "stream_msgs_per_s": round(count / elapsed),
        "sender_us_per_msg": round(sender_s / count * 1e6, 2),
    }


_LINKS = (
    ("zmq-ipc msgspec (now)", "msgspec"),
    ("zmq-ipc pickle (before)", "pickle"),
    ("multiprocessing.Pipe pickle", "pipe"),
)


def _codec_costs(count: int) -> dict[str, dict[str, float]]:
    """One output message encoded and decoded in this process: the codec's share of each send, without IPC."""
    codec_out, codec_in = Codec(ToWorker), Codec(ToServer)
    message, legacy = Out(_SAMPLE_OUTPUT), ("out", _PICKLED_OUTPUT)
    frame, pickled = codec_out.encode(message), pickle.dumps(legacy, pickle.DEFAULT_PROTOCOL)

    def per_call(fn: Any) -> float:
        started = time.perf_counter()
        for _ in range(count):
            fn()
        return round((time.perf_counter() - started) / count * 1e6, 2)

    return {
        "msgspec": {
            "encode_us": per_call(lambda: codec_out.encode(Out(_SAMPLE_OUTPUT))),
            "decode_us": per_call(lambda: codec_in.decode(frame)),
            "bytes": len(frame),
        },
        "pickle": {
            "encode_us": per_call(lambda: pickle.dumps(legacy, pickle.DEFAULT_PROTOCOL)),
            "decode_us": per_call(lambda: pickle.loads(pickled)),
            "bytes": len(pickled),
        },
    }


def transport_command(args: argparse.Namespace) -> dict:
    """Each link measured `--repeats` times, the links interleaved (these machines are noisy); medians reported."""
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name, _ in _LINKS}
    for _ in range(args.repeats):
        for name, kind in _LINKS:
            rounds[name].append(_measure_link(kind, args.round_trips))
    results = {
        name: {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        for name, rows in rounds.items()
    }
    now, before = results["zmq-ipc msgspec (now)"], results["zmq-ipc pickle (before)"]
    return {
        "bench": "routing.transport",
        "count": args.round_trips,
        "repeats": args.repeats,
        "results": results,
        "codec": _codec_costs(100_000),
        "msgspec_vs_pickle": {
            "stream_msgs_per_s": round(now["stream_msgs_per_s"] / before["stream_msgs_per_s"], 2),
            "sender_us_per_msg": round(now["sender_us_per_msg"] / before["sender_us_per_msg"], 2),
            "rtt_p50": round(now["p50_us"] / before["p50_us"], 2),
        },
        "rounds": rounds,
    }


def print_transport_table(report: dict) -> None:
    print(
        f"worker link between two processes: {report['count']} submit round trips (a 2,048-token request), then a "
        f"stream of {report['count']} GenerationOutputs (worker -> server); medians of {report['repeats']} rounds"
    )
    print(f"{'link':<30}{'RTT p50 us':>11}{'p99 us':>9}{'stream msg/s':>14}{'sender us/msg':>15}")
    for name, row in report["results"].items():
        print(
            f"{name:<30}{row['p50_us']:>11}{row['p99_us']:>9}{round(row['stream_msgs_per_s']):>14,}"
            f"{row['sender_us_per_msg']:>15}"
        )
    ratio = report["msgspec_vs_pickle"]
    print(
        f"msgspec / pickle on ZMQ: stream {ratio['stream_msgs_per_s']}x msg/s, {ratio['sender_us_per_msg']}x sender "
        f"time per message, {ratio['rtt_p50']}x RTT p50"
    )
    print(f"{'one output message, in process':<30}{'encode us':>11}{'decode us':>11}{'bytes':>7}")
    for name, row in report["codec"].items():
        print(f"{name:<30}{row['encode_us']:>11}{row['decode_us']:>11}{row['bytes']:>7}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    decision = sub.add_parser("decision", help="router decision latency over a large index")
    decision.add_argument("--index-blocks", type=int, default=1_000_000)
    decision.add_argument("--workers", type=int, default=8)
    decision.add_argument("--decisions", type=int, default=5000)
    decision.add_argument("--seed", type=int, default=0)
    replay = sub.add_parser("replay", help="Mooncake trace through the router, simulated workers")
    replay.add_argument("--conversations", type=int, default=48, help="whole conversations, in trace order")
    replay.add_argument("--min-turns", type=int, default=2, help="only conversations with this many requests")
    replay.add_argument("--max-output", type=int, default=64, help="output tokens cap")
    replay.add_argument("--workers", type=int, default=4)
    replay.add_argument(
        "--block-tokens", type=int, default=64, help="tokens per trace hash id (512 originally)"
    )
    replay.add_argument(
        "--g1-blocks", type=int, default=1024, help="prefix-cache capacity per worker, blocks"
    )
    replay.add_argument("--speedup", type=float, default=2.0, help="trace time compression")
    real = sub.add_parser("replay-real", help="a small slice through RoutedEngine over real SmolLM2 workers")
    real.add_argument("--conversations", type=int, default=6)
    real.add_argument("--min-turns", type=int, default=3)
    real.add_argument("--max-output", type=int, default=8)
    real.add_argument("--max-blocks", type=int, default=48, help="prompt blocks kept (a prefix of the ids)")
    real.add_argument("--block-tokens", type=int, default=16)
    real.add_argument("--kv-blocks", type=int, default=600, help="G1 pool per worker, blocks")
    real.add_argument("--workers", type=int, default=2)
    real.add_argument("--threads-per-worker", type=int, default=1)
    real.add_argument("--duration-s", type=float, default=90.0, help="the slice's arrivals span this long")
    real.add_argument(
        "--strategies",
        default="kv-aware,round-robin",
        help="run in this order (machine noise drifts: compare both orders)",
    )
    real.add_argument(
        "--model-cache", default=str(Path(__file__).resolve().parent.parent / ".strata-cache" / "models")
    )
    serve = sub.add_parser(
        "replay-serve", help="a slice against `strata serve --workers N` over the OpenAI API"
    )
    serve.add_argument("--conversations", type=int, default=12)
    serve.add_argument("--min-turns", type=int, default=3)
    serve.add_argument("--max-output", type=int, default=16)
    serve.add_argument("--max-blocks", type=int, default=48, help="prompt blocks kept (a prefix of the ids)")
    serve.add_argument("--block-tokens", type=int, default=16)
    serve.add_argument("--kv-blocks", type=int, default=600, help="G1 pool per worker, blocks")
    serve.add_argument("--max-num-batched-tokens", type=int, default=1024)
    serve.add_argument("--workers", type=int, default=2)
    serve.add_argument("--threads-per-worker", type=int, default=1)
    serve.add_argument("--duration-s", type=float, default=120.0, help="the slice's arrivals span this long")
    serve.add_argument("--tiers", default="g1,g2", help="g1: --no-kvbm; g2: G1 + shared host pool")
    serve.add_argument("--host-cache-gb", type=float, default=1.0)
    serve.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every strategy and tier; the table shows "
        "medians, and each round's hit rate and TTFT ratio",
    )
    serve.add_argument(
        "--keep-logs",
        default="",
        help="directory for each run's server log (router decisions "
        "at DEBUG) and per-request timings, to see where hits were lost",
    )
    serve.add_argument(
        "--strategies",
        default="kv-aware,round-robin",
        help="run in this order; also kv-aware-in-flight (--router-count-in-flight); a suffix @W sets "
        "--router-overlap-weight W (kv-aware@4)",
    )
    serve.add_argument(
        "--model-cache", default=str(Path(__file__).resolve().parent.parent / ".strata-cache" / "models")
    )
    transport = sub.add_parser(
        "transport", help="worker link: msgspec vs pickled tuples vs multiprocessing.Pipe"
    )
    transport.add_argument("--round-trips", type=int, default=5000)
    transport.add_argument(
        "--repeats", type=int, default=3, help="rounds of every link, interleaved; medians shown"
    )
    args = parser.parse_args()
    commands = {
        "decision": (decision_bench, print_decision_table),
        "replay": (replay_command, print_replay_table),
        "transport": (transport_command, print_transport_table),
        "replay-real": (replay_real_command, print_replay_real_table),
        "replay-serve": (replay_serve_command, print_replay_serve_table),
    }
    run, show = commands[args.command]
    report = run(args)
    show(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
