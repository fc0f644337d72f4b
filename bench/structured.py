"""What 2026 clients' extra fields cost: logprobs on a decoding batch, and lm-eval-style loglikelihood requests.

    .venv/bin/python bench/structured.py [--dtype float32] [--reps 3] [--streams 8]

One `strata serve` of SmolLM2 (harness.servers.strata_openai); every figure is a median over --reps rounds, and in
each round the case and its baseline run back to back (in alternating order), so the machine's drifts hit both:

  logprobs       ITL p50 of --streams concurrent greedy streams (256-token prompts, 64 tokens) with
                 `logprobs: 5` against the same streams without (the issue's bound: <= 1.05x)
  json_schema    the same streams with a json_schema response_format (a list of up to 60 short strings, so
                 that a stream runs about as long as the plain one) against the same streams without
                 (bound: <= 1.10x)
  compile        the grammar of a typical schema (an object of 8 typed properties, one an array of enums) built
                 in process as an engine builds it at submit: a schema seen for the first time (each rep a new
                 property name) and one already cached; median milliseconds
  loglikelihood  lm-evaluation-harness's `local-completions` request: a batch of 8 token-id prompts (200-token
                 contexts), `echo: true, logprobs: 1, max_tokens: 1`: prompts/s, against the same batch without
                 echo and logprobs (a plain 1-token completion with a fresh cache_salt each round, so that its
                 prompts are prefilled too: the ratio is the price of the prompt's logits and logprobs)

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from harness.figures import VOCAB_HIGH, VOCAB_LOW  # noqa: E402
from harness.load import stream_together  # noqa: E402
from harness.servers import strata_openai, use_run_secret  # noqa: E402
from harness.stats import percentile  # noqa: E402


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def itl_p50_ms(client: httpx.Client, url: str, prompts: list[list[int]], extra: dict | None) -> float:
    """ITL p50 (ms) of streams sent together: the gaps between each stream's chunks."""
    timings = stream_together(client, url, prompts, 64, extra)
    gaps = [b - a for t in timings for a, b in itertools.pairwise(t.chunk_times)]
    return percentile(gaps, 50) * 1000


def loglikelihood_rate(
    client: httpx.Client, url: str, batch: list[list[int]], echo: bool, salt: str
) -> float:
    """Prompts/s of one lm-eval-style batch request (`echo` and `logprobs: 1`) or of the plain one."""
    body = {
        "model": "smollm2",
        "prompt": batch,
        "max_tokens": 1,
        "temperature": 0,
        "seed": 1234,
        "cache_salt": salt,
    }
    if echo:
        body |= {"echo": True, "logprobs": 1}
    started = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=body)
    response.raise_for_status()
    elapsed = time.perf_counter() - started
    if echo:  # what lm-eval reads: one logprob per prompt token after the first, then the generated token
        for prompt, choice in zip(batch, response.json()["choices"], strict=True):
            assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1
    return len(batch) / elapsed


SCHEMA = {
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "list",
            "schema": {
                "type": "object",
                "properties": {
                    "items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 60}
                },
                "required": ["items"],
            },
        },
    }
}


def typical_schema(name: str) -> dict:
    return {
        "type": "object",
        "properties": {
            name: {"type": "string", "maxLength": 40},
            "email": {"type": "string", "format": "email"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "score": {"type": "number"},
            "active": {"type": "boolean"},
            "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]}, "maxItems": 3},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            },
            "notes": {"type": ["string", "null"]},
        },
        "required": [name, "age", "active"],
        "additionalProperties": False,
    }


def compile_times(reps: int) -> dict[str, list[float]]:
    """Milliseconds to build a request's matcher from a new schema and from a cached one (GrammarCompiler, as
    an engine's submit does), with SmolLM2's tokenizer (built once before timing: an engine builds it once)."""
    from server.engine.api import structured_spec
    from server.engine.config import DEFAULT_MODEL
    from server.engine.loader import prepare_model
    from server.engine.structured import GrammarCompiler

    folder = prepare_model(DEFAULT_MODEL).folder
    model = json.loads((folder / "config.json").read_text())
    eos = model["eos_token_id"]
    compiler = GrammarCompiler(
        folder / "tokenizer.json", model["vocab_size"], eos if isinstance(eos, list) else [eos]
    )
    compiler.matcher(structured_spec("warm", "json", typical_schema("warm")), [])
    out: dict[str, list[float]] = {"compile_new_schema_ms": [], "compile_cached_schema_ms": []}
    for rep in range(max(reps, 5)):
        spec = structured_spec("s", "json", typical_schema(f"name_{rep}"))
        for name in ("compile_new_schema_ms", "compile_cached_schema_ms"):
            started = time.perf_counter()
            compiler.matcher(spec, [])
            out[name].append((time.perf_counter() - started) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    use_run_secret()
    rng = random.Random(1)
    results: dict[str, list[float]] = {}
    with (
        strata_openai(args.dtype, args.threads) as server,
        httpx.Client(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=64)) as client,
    ):
        itl_p50_ms(client, server.url, [tokens(rng, 64)], None)  # warm up
        batch = [tokens(rng, 200) for _ in range(8)]
        for rep in range(args.reps):
            streams = [tokens(rng, 256) for _ in range(args.streams)]
            cases = [
                ("itl_plain_ms", None),
                ("itl_logprobs5_ms", {"logprobs": 5}),
                ("itl_json_schema_ms", SCHEMA),
            ]
            for name, extra in cases if rep % 2 == 0 else cases[::-1]:
                results.setdefault(name, []).append(itl_p50_ms(client, server.url, streams, extra))
            for echo in (True, False) if rep % 2 == 0 else (False, True):
                name = "loglikelihood_prompts_s" if echo else "plain_1_token_prompts_s"
                rate = loglikelihood_rate(client, server.url, batch, echo, f"{name}-{rep}")
                results.setdefault(name, []).append(rate)
    results |= compile_times(args.reps)
    medians = {name: statistics.median(values) for name, values in results.items()}
    ratios = {
        "logprobs5_itl_ratio": medians["itl_logprobs5_ms"] / medians["itl_plain_ms"],
        "json_schema_itl_ratio": medians["itl_json_schema_ms"] / medians["itl_plain_ms"],
        "loglikelihood_vs_plain": medians["loglikelihood_prompts_s"] / medians["plain_1_token_prompts_s"],
    }
    print(f"strata serve, SmolLM2 {args.dtype}, {args.threads} threads, medians of {args.reps}")
    rows = [
        (name, f"{value:.2f}", " ".join(f"{v:.2f}" for v in results[name])) for name, value in medians.items()
    ]
    rows += [(name, f"{value:.3f}x", "") for name, value in ratios.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in [("metric", "median", "rounds"), *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    summary = {"bench": "structured", "dtype": args.dtype, "threads": args.threads, "reps": args.reps}
    summary |= {name: round(value, 3) for name, value in {**medians, **ratios}.items()}
    summary["rounds"] = {name: [round(v, 3) for v in values] for name, values in results.items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
