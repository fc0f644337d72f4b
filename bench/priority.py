"""Priority scheduling against FCFS in Strata's engine (SmolLM2), the same load on both.

Each round runs the load once per policy (the order alternates by round), each on a fresh engine with
--max-concurrent requests running at most: --low background requests (priority 10, --low-tokens each) submitted at
once, then --high interactive ones (priority 0, --high-tokens each) arriving every --gap seconds. Under fcfs every
request's priority is 0 (fcfs takes no other). Reported: the high class's p50/p90 TTFT and the low class's
throughput (its output tokens over the time its last request took), every request's throughput (all output tokens
over the whole load's time: what preemption's recompute costs), medians over rounds. Goals: high p90 TTFT at least
3x better under priority; low throughput >= 0.9x. The low class's time also holds the high class's own work under
priority (it runs first), so its ratio is bounded by the share of the tokens the low class has.

    python bench/priority.py [--rounds 3] [--low 12] [--high 8] [--max-concurrent 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from bench.machine import cores, cpu_name  # noqa: E402
from harness.stats import percentile  # noqa: E402
from server.engine.api import GenerationOutput, GenerationRequest, RequestId, SamplingParams  # noqa: E402
from server.engine.config import EngineConfig  # noqa: E402
from server.engine.llm_engine import LLMEngine  # noqa: E402

TOPICS = ["rivers", "volcanoes", "bridges", "compilers", "orchards", "glaciers", "lighthouses", "telescopes"]


def prompt(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return (
        f"Request {i}. Write a short, clear paragraph for a curious student about {topic}, with one example."
    )


class Load:
    """One run of the load: per request, when it was submitted, its first token and its end."""

    def __init__(self) -> None:
        self.submitted: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.ended: dict[str, float] = {}
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.expected = 0

    def sink(self, output: GenerationOutput) -> None:
        now = time.perf_counter()
        with self._lock:
            rid = output.request_id
            if output.new_token_ids and rid not in self.first:
                self.first[rid] = now
            self.tokens[rid] = self.tokens.get(rid, 0) + len(output.new_token_ids)
            if output.finished:
                assert output.finish_reason != "error", output.error
                self.ended[rid] = now
                if len(self.ended) == self.expected:
                    self.done.set()


def run(policy: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    config = EngineConfig(
        dtype=args.dtype, device="cpu", max_concurrent_requests=args.max_concurrent, num_kv_blocks=1024,
        max_model_len=2048, scheduling_policy=policy,
    )  # fmt: skip
    load = Load()
    load.expected = args.low + args.high
    with LLMEngine(config) as engine:
        warm = GenerationRequest(RequestId("warm"), prompts[0], SamplingParams(max_tokens=2, temperature=0))
        engine.submit(warm, lambda o: None)
        time.sleep(2)

        def submit(name: str, ids: list[int], max_tokens: int, priority: int) -> None:
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            load.submitted[name] = time.perf_counter()
            engine.submit(GenerationRequest(RequestId(name), ids, sampling, priority=priority), load.sink)

        for i in range(args.low):
            submit(f"low{i}", prompts[i], args.low_tokens, 10 if policy == "priority" else 0)
        for i in range(args.high):
            time.sleep(args.gap)
            submit(f"high{i}", prompts[args.low + i], args.high_tokens, 0)
        if not load.done.wait(600):
            raise TimeoutError(f"{policy}: the load did not finish")
        preemptions = engine.stats().num_preemptions
    highs = [load.first[f"high{i}"] - load.submitted[f"high{i}"] for i in range(args.high)]
    lows = [f"low{i}" for i in range(args.low)]
    low_span = max(load.ended[r] for r in lows) - min(load.submitted[r] for r in lows)
    span = max(load.ended.values()) - min(load.submitted.values())
    return {
        "high_ttft_p50": percentile(highs, 50),
        "high_ttft_p90": percentile(highs, 90),
        "low_tok_s": sum(load.tokens[r] for r in lows) / low_span,
        "all_tok_s": sum(load.tokens.values()) / span,
        "preemptions": preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--low", type=int, default=12)
    parser.add_argument("--high", type=int, default=8)
    parser.add_argument("--low-tokens", type=int, default=48)
    parser.add_argument("--high-tokens", type=int, default=16)
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between high-priority arrivals")
    parser.add_argument("--max-concurrent", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    with LLMEngine(EngineConfig(dtype=args.dtype, device="cpu", num_kv_blocks=64)) as tokenizer:
        prompts = [tokenizer.encode(prompt(i)) for i in range(args.low + args.high)]
    rounds: list[dict[str, dict[str, float]]] = []
    for index in range(args.rounds):
        order = ["fcfs", "priority"] if index % 2 == 0 else ["priority", "fcfs"]
        rounds.append({policy: run(policy, args, prompts) for policy in order})
    cells = {
        policy: {key: statistics.median(r[policy][key] for r in rounds) for key in rounds[0][policy]}
        for policy in ("fcfs", "priority")
    }
    ttft_gain = cells["fcfs"]["high_ttft_p90"] / cells["priority"]["high_ttft_p90"]
    low_ratio = cells["priority"]["low_tok_s"] / cells["fcfs"]["low_tok_s"]
    all_ratio = cells["priority"]["all_tok_s"] / cells["fcfs"]["all_tok_s"]
    cpu = f"{cpu_name()}, {cores()} cores"
    print(f"\n{cpu}; {args.dtype}; {args.rounds} rounds, medians; max {args.max_concurrent} running; {args.low} low x "
          f"{args.low_tokens} tokens at once, {args.high} high x {args.high_tokens} tokens every {args.gap:g} s")  # fmt: skip
    header = ("high TTFT p50 s", "high TTFT p90 s", "low tok/s", "all tok/s", "preempted")
    print(f"{'policy':10} " + " ".join(f"{h:>16}" for h in header))
    for policy, c in cells.items():
        values = (c["high_ttft_p50"], c["high_ttft_p90"], c["low_tok_s"], c["all_tok_s"], c["preemptions"])
        print(f"{policy:10} " + " ".join(f"{v:>16.3f}" for v in values))
    print(f"high p90 TTFT, fcfs / priority: {ttft_gain:.2f}x (goal >= 3x); low throughput, priority / fcfs: "
          f"{low_ratio:.3f} (goal >= 0.9); all requests, priority / fcfs: {all_ratio:.3f}")  # fmt: skip
    summary = {"bench": "priority", "cpu": cpu, "dtype": args.dtype, "rounds": args.rounds, "cells": cells}
    summary |= {"high_p90_gain": round(ttft_gain, 3), "low_throughput_ratio": round(low_ratio, 3)}
    summary |= {"all_throughput_ratio": round(all_ratio, 3)}
    summary |= {"met": ttft_gain >= 3 and low_ratio >= 0.9, "per_round": rounds}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
