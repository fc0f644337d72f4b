"""Strata's engine against transformers in the same run, same weights, same dtype.

    .venv/bin/python bench/engine.py [--dtype float32|bfloat16] [--requests 200] [--reps 3] [--skip-baseline]

Measures (medians over --reps where repeated):
  prefill     time to first token of a fresh (uncached) prompt of 128 / 512 / 2048 tokens -> tokens/s;
              transformers: one forward of the prompt (logits of the last position only)
  decode      batch-1 generation of 64 tokens after a 256-token prompt, tokens/s after the first token
  serving     8 and 32 concurrent requests, prompt 32-384 and output 16-96 tokens (seeded), generated tokens / wall;
              transformers: one batched `generate` over the same requests (left padding, greedy, no early EOS);
              --reps rounds, each ours then theirs on fresh prompts, medians
  prefix TTFT 2048-token prompt whose first 2032 tokens are cached (a previous request) vs a fresh one
  shared prompt  4 requests with one fresh 1,008-token prompt submitted together: time until the last first token,
              with the scheduler waiting for the prefix a running request computes vs computing it 4 times
  RSS         peak and current resident memory after every quarter of --requests short requests (steady = no growth);
              the process's, so it includes transformers' model unless --skip-baseline
Prints three tables (against transformers; Strata with and without its prefix cache and its prefix wait; RSS),
then one JSON line; "-" in a table and null in the JSON where transformers was not run.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.engine.api import GenerationRequest, RequestId, SamplingParams  # noqa: E402
from server.engine.config import (
    DEFAULT_MODEL,  # noqa: E402
    EngineConfig,  # noqa: E402
)
from server.engine.llm_engine import LLMEngine  # noqa: E402

VOCAB_LOW, VOCAB_HIGH = 100, 40_000  # plain-text token ids, far from special tokens


class Runner:
    """Our engine plus helpers that time requests from submit to first and last output."""

    def __init__(self, engine: LLMEngine, rng: random.Random) -> None:
        self.engine = engine
        self.rng = rng
        self.count = 0

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

    def request(self, prompt: list[int], max_tokens: int) -> GenerationRequest:
        self.count += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return GenerationRequest(RequestId(f"bench-{self.count}"), prompt, params)

    def run_batch(self, requests: list[GenerationRequest]) -> tuple[float, list[float], int]:
        """Submit all at once; return wall seconds, per-request TTFT seconds, generated tokens."""
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        started = time.perf_counter()
        for request in requests:
            self.engine.submit(request, outputs.put)
        first: dict[str, float] = {}
        generated = finished = 0
        while finished < len(requests):
            output = outputs.get(timeout=600)
            first.setdefault(output.request_id, time.perf_counter() - started)
            generated += len(output.new_token_ids)
            finished += output.finished
        return time.perf_counter() - started, list(first.values()), generated


def hf_prefill(model, prompt: list[int]) -> float:
    started = time.perf_counter()
    with torch.inference_mode():
        model(torch.tensor([prompt]), logits_to_keep=1)
    return time.perf_counter() - started


def hf_generate(model, prompts: list[list[int]], max_new: int) -> float:
    """Batched greedy generate with left padding; every row runs max_new steps (no early EOS)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return time.perf_counter() - started


def bench_prefill(runner: Runner, model, reps: int) -> dict:
    result = {}
    for length in (128, 512, 2048):
        ours = [runner.run_batch([runner.request(runner.tokens(length), 1)])[1][0] for _ in range(reps)]
        theirs = [hf_prefill(model, runner.tokens(length)) for _ in range(reps)] if model else []
        theirs_tok_s = length / statistics.median(theirs) if theirs else None
        result[length] = (length / statistics.median(ours), theirs_tok_s)
    return result


def bench_decode(runner: Runner, model, reps: int) -> tuple[float, float | None]:
    steps = 64
    ours = []
    for _ in range(reps):
        wall, ttft, _ = runner.run_batch([runner.request(runner.tokens(256), steps)])
        ours.append((steps - 1) / (wall - ttft[0]))
    theirs = []
    for _ in range(reps if model else 0):
        prompt = runner.tokens(256)
        total = hf_generate(model, [prompt], steps)
        theirs.append((steps - 1) / (total - hf_prefill(model, prompt)))
    return statistics.median(ours), statistics.median(theirs) if theirs else None


def bench_serving(runner: Runner, model, concurrency: int, reps: int) -> tuple[float, float | None]:
    """Medians over `reps` rounds; each round runs ours then transformers on the same fresh prompts (uncached)."""
    rng = random.Random(concurrency)
    shapes = [(rng.randint(32, 384), rng.randint(16, 96)) for _ in range(concurrency)]
    ours, theirs = [], []
    for _ in range(reps):
        prompts = [runner.tokens(n) for n, _ in shapes]
        wall, _, generated = runner.run_batch(
            [runner.request(p, out) for p, (_, out) in zip(prompts, shapes, strict=True)]
        )
        ours.append(generated / wall)
        if model is not None:
            wanted = sum(out for _, out in shapes)
            theirs.append(wanted / hf_generate(model, prompts, max(out for _, out in shapes)))
    return statistics.median(ours), statistics.median(theirs) if theirs else None


def bench_prefix_ttft(runner: Runner, reps: int) -> tuple[float, float]:
    cached, fresh = [], []
    for _ in range(reps):
        prefix = runner.tokens(2032)
        runner.run_batch([runner.request(prefix + runner.tokens(16), 1)])  # leaves 127 full blocks cached
        cached.append(runner.run_batch([runner.request(prefix + runner.tokens(16), 1)])[1][0])
        fresh.append(runner.run_batch([runner.request(runner.tokens(2048), 1)])[1][0])
    return statistics.median(fresh), statistics.median(cached)


def bench_shared_prompt(runner: Runner, reps: int, n: int = 4) -> tuple[float, float]:
    """n requests with one fresh 1,008-token prompt submitted together (OpenAI `n`, or parallel agents):
    seconds until every first token, with the scheduler's wait for a running prefix, then without it."""
    timings = {True: [], False: []}
    scheduler = runner.engine.scheduler
    try:
        for _ in range(reps):
            for wait in (True, False):
                scheduler.wait_for_running_prefix = wait  # read by the engine thread at its next step
                prompt = runner.tokens(1008)
                timings[wait].append(max(runner.run_batch([runner.request(prompt, 1) for _ in range(n)])[1]))
    finally:
        scheduler.wait_for_running_prefix = True
    return statistics.median(timings[True]), statistics.median(timings[False])


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process, MiB."""
    fields = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def bench_rss(runner: Runner, total: int) -> list[tuple[int, float, float]]:
    points, done, wave = [], 0, 16
    quarter = max(wave, total // 4)
    while done < total:
        batch = min(wave, total - done)
        runner.run_batch(
            [runner.request(runner.tokens(runner.rng.randint(16, 200)), 8) for _ in range(batch)]
        )
        done += batch
        if done % quarter < wave or done == total:
            points.append((done, *rss_mib()))
    return points


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=200, help="requests for the RSS check")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-baseline", action="store_true", help="do not load or run transformers")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=args.model, dtype=args.dtype, device="cpu", cache_dir=args.cache_dir, num_kv_blocks=800,
        max_model_len=4096, max_num_batched_tokens=2048, max_concurrent_requests=64, num_threads=args.threads,
    )  # fmt: skip
    engine = LLMEngine(config)
    runner = Runner(engine, random.Random(0))
    model = None
    if not args.skip_baseline:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(engine.files.folder, dtype=config.torch_dtype).eval()
    runner.run_batch([runner.request(runner.tokens(64), 4)])  # warm-up
    if model is not None:
        hf_prefill(model, runner.tokens(64))
    try:
        results = run_all(runner, model, args)
    finally:
        engine.close()
    print_report(results, args, baseline_loaded=model is not None)


def run_all(runner: Runner, model, args) -> dict:
    prefill = bench_prefill(runner, model, args.reps)
    decode = bench_decode(runner, model, args.reps)
    serving = {c: bench_serving(runner, model, c, args.reps) for c in (8, 32)}
    fresh, cached = bench_prefix_ttft(runner, args.reps)
    shared = bench_shared_prompt(runner, args.reps)
    rss = bench_rss(runner, args.requests)
    return {
        "prefill": prefill,
        "decode": decode,
        "serving": serving,
        "ttft": (fresh, cached),
        "shared": shared,
        "rss": rss,
    }


def ratio(ours: float, theirs: float | None) -> float | None:
    """ours / theirs; None where there is no baseline (--skip-baseline) or it is 0."""
    return ours / theirs if theirs else None


def cell(value: float | None, digits: int, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def against_row(label: str, ours: float, theirs: float | None, digits: int) -> tuple[str, ...]:
    return (label, f"{ours:.{digits}f}", cell(theirs, digits), cell(ratio(ours, theirs), 2, "x"))


def print_table(title: str, rows: list[tuple[str, ...]]) -> None:
    """`rows[0]` is the heading; every column holds what its heading says, "-" where it was not measured."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print(title)
    for row in rows:
        print("  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)))


def print_report(results: dict, args, baseline_loaded: bool) -> None:
    """Three tables, each with columns of one kind: Strata against transformers (tokens/s), Strata with a
    feature against Strata without it (seconds), and this process's RSS (MiB)."""
    rows = [("metric", "strata", "transformers", "strata / transformers")]
    rows += [against_row(f"prefill {n} tok/s", *pair, 0) for n, pair in results["prefill"].items()]
    rows.append(against_row("decode batch 1 tok/s", *results["decode"], 1))
    rows += [against_row(f"serving {n} concurrent tok/s", *pair, 1) for n, pair in results["serving"].items()]
    title = f"strata engine vs transformers, {args.dtype}, {args.threads} threads, medians of {args.reps}"
    print_table(title, rows)
    fresh, cached = results["ttft"]
    waited, duplicated = results["shared"]
    print_table(
        f"\nstrata engine with and without a feature, seconds, medians of {args.reps}",
        [
            ("case", "feature", "with s", "without s", "without / with"),
            ("TTFT of a 2048-token prompt", "2032 tokens cached", f"{cached:.3f}", f"{fresh:.3f}",
             f"{fresh / cached:.1f}x"),
            ("4 x one fresh 1008-token prompt, last TTFT", "prefix wait", f"{waited:.3f}", f"{duplicated:.3f}",
             f"{duplicated / waited:.2f}x"),
        ],
    )  # fmt: skip
    holds = "strata engine and transformers' model" if baseline_loaded else "strata engine only"
    rss_rows = [("requests done", "RSS MiB", "peak RSS MiB")]
    rss_rows += [(str(done), f"{current:.0f}", f"{peak:.0f}") for done, current, peak in results["rss"]]
    print_table(f"\nthis process's RSS (it holds the {holds})", rss_rows)
    print(json.dumps(summary(results, args, baseline_loaded)))


def summary(results: dict, args, baseline_loaded: bool) -> dict:
    """The JSON line; a ratio is null where transformers was not run."""
    fresh, cached = results["ttft"]
    waited, duplicated = results["shared"]
    rss = results["rss"]
    decode, decode_theirs = results["decode"]
    return {
        "bench": "engine", "dtype": args.dtype, "threads": args.threads, "reps": args.reps,
        "prefill_tok_s": {str(k): round(v[0], 1) for k, v in results["prefill"].items()},
        "prefill_ratio": {str(k): rounded(ratio(*v), 3) for k, v in results["prefill"].items()},
        "decode_b1_tok_s": round(decode, 2), "decode_b1_ratio": rounded(ratio(decode, decode_theirs), 3),
        "serving_tok_s": {str(k): round(v[0], 1) for k, v in results["serving"].items()},
        "serving_ratio": {str(k): rounded(ratio(*v), 3) for k, v in results["serving"].items()},
        "ttft_uncached_s": round(fresh, 4), "ttft_cached_s": round(cached, 4), "ttft_ratio": round(fresh / cached, 2),
        "shared_prompt_last_ttft_s": {"wait": round(waited, 4), "no_wait": round(duplicated, 4)},
        "shared_prompt_ratio": round(duplicated / waited, 2),
        "rss_mib": [[d, round(c), round(p)] for d, c, p in rss],
        "rss_growth_mib": round(rss[-1][1] - rss[0][1], 1),
        "rss_includes_transformers_model": baseline_loaded,
    }  # fmt: skip


def rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


if __name__ == "__main__":
    main()
