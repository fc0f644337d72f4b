"""Where a first token's time goes, per request, from the request's own trace: a Mooncake slice replayed through
`strata serve --workers N` traced (every request sampled) to an OTLP receiver in this process (harness/otlp.py).

    python bench/ttft_breakdown.py [--conversations 12] [--workers 2] [--duration-s 60] [--strata-args "..."]

Each request's time to its first token splits into (ms, from its spans: docs/observability.md):
  frontend   HTTP request received -> the router's placement starts (parsing, checks, the hop to a thread)
  place      the placement starts -> the worker's engine has the request (routing, the Submit message)
  queue      in the engine's wait queue, until admitted
  onboard    tier reads at admission (the part of `queue` spent reading G2..G5)
  prefill    the prompt's chunks' forward steps (each a step shared with the batch's other requests)
  between    after admission, waiting between its chunks while other steps ran
  sample     the last chunk's end -> its first token
Reported for the fastest half and the slowest tenth of first tokens (medians of each phase), and the slowest
requests one by one. What differs between the two groups is what makes the tail. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from bench.machine import cores, cpu_name  # noqa: E402
from harness.load import StreamTiming, drive, summarize  # noqa: E402
from harness.otlp import OTLPReceiver, ReceivedSpan  # noqa: E402
from harness.servers import MODEL_CACHE, smollm2_repository, start_strata, use_run_secret  # noqa: E402
from harness.trace import add_trace_flags, trace_prompts  # noqa: E402

PHASES = ("frontend", "place", "queue", "onboard", "prefill", "between", "sample")


@dataclass(slots=True)
class Breakdown:
    request_id: str
    ttft_ms: float  # the server's: its first span's start to the engine's first token
    prompt_tokens: int
    cached_tokens: int
    chunks: int
    worker: str
    frontend: float = 0.0
    place: float = 0.0
    queue: float = 0.0
    onboard: float = 0.0
    prefill: float = 0.0
    between: float = 0.0
    sample: float = 0.0


def breakdown(request_id: str, spans: list[ReceivedSpan]) -> Breakdown | None:
    """The phases of one request's first token from its trace's spans (None when a span is missing)."""
    named: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    try:
        (server,) = [
            s
            for s in spans
            if s.attributes.get("strata.request_id") == request_id and s.name.startswith("POST")
        ]
        (engine,) = named["strata.engine.request"]
        (queue,) = named["strata.engine.queue"]
        place = named["strata.router.place"][0]
        first = engine.event_ns[engine.events.index("first_token")]
    except (KeyError, ValueError):
        return None
    chunks = sorted(named.get("strata.engine.prefill", []), key=lambda s: s.start_ns)
    prefill = sum(s.end_ns - s.start_ns for s in chunks)
    last_chunk_end = chunks[-1].end_ns if chunks else queue.end_ns
    ms = 1e-6
    return Breakdown(
        request_id=request_id,
        ttft_ms=(first - server.start_ns) * ms,
        prompt_tokens=int(engine.attributes.get("gen_ai.usage.input_tokens", 0)),
        cached_tokens=int(engine.attributes.get("strata.usage.cached_tokens", 0)),
        chunks=len(chunks),
        worker=str(place.attributes.get("strata.worker.id", engine.service)),
        frontend=(place.start_ns - server.start_ns) * ms,
        place=(engine.start_ns - place.start_ns) * ms,
        queue=(queue.end_ns - queue.start_ns) * ms,
        onboard=sum(s.end_ns - s.start_ns for s in named.get("strata.kvbm.onboard", [])) * ms,
        prefill=prefill * ms,
        between=max(0.0, (last_chunk_end - queue.end_ns - prefill) * ms),
        sample=(first - last_chunk_end) * ms,
    )


def group_medians(rows: list[Breakdown]) -> dict[str, float]:
    figures = {phase: statistics.median(getattr(r, phase) for r in rows) for phase in PHASES}
    figures |= {
        "ttft_ms": statistics.median(r.ttft_ms for r in rows),
        "prompt_tokens": statistics.median(r.prompt_tokens for r in rows),
        "uncached_tokens": statistics.median(r.prompt_tokens - r.cached_tokens for r in rows),
        "chunks": statistics.median(r.chunks for r in rows),
    }
    return {key: round(value, 2) for key, value in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_trace_flags(
        parser, conversations=12, min_turns=3, max_output=16, max_blocks=48, block_tokens=16, duration_s=60.0
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kv-blocks", type=int, default=600, help="G1 pool per worker, blocks")
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--strata-args", default="", help="more `strata serve` flags")
    parser.add_argument("--slowest", type=int, default=5, help="slowest requests shown one by one")
    args = parser.parse_args()
    use_run_secret()
    prompts, _, _ = trace_prompts(args)
    with tempfile.TemporaryDirectory(prefix="strata-ttft-") as tmp, OTLPReceiver() as receiver:
        root = Path(tmp)
        repository = smollm2_repository(
            root, block_size=args.block_tokens, num_kv_blocks=args.kv_blocks, num_threads=args.threads_per_worker,
            cache_dir=str(MODEL_CACHE), max_num_batched_tokens=args.max_num_batched_tokens,
        )  # fmt: skip
        flags = ["--workers", str(args.workers), "--no-kvbm", "--otlp-traces-endpoint", receiver.url]
        server = start_strata(repository, root, *flags, *shlex.split(args.strata_args))
        try:
            timings = drive(server.openai_url, prompts, args.duration_s)
        finally:
            server.stop()  # its processes export what they buffered as they stop
        spans = receiver.spans
    report(args, timings, spans)


def report(args: argparse.Namespace, timings: list[StreamTiming], spans: list[ReceivedSpan]) -> None:
    by_trace: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    trace_of = {
        span.attributes["strata.request_id"]: span.trace_id
        for span in spans
        if span.name.startswith("POST") and "strata.request_id" in span.attributes
    }
    rows = []
    for timing in timings:
        request_id = timing.response_id.removeprefix("cmpl-")
        row = breakdown(request_id, by_trace.get(trace_of.get(request_id, ""), []))
        if row is not None and timing.error is None:
            rows.append(row)
    rows.sort(key=lambda r: r.ttft_ms)
    fast, tail = rows[: len(rows) // 2], rows[-max(1, len(rows) // 10) :]
    groups = {"fastest half": group_medians(fast), "slowest tenth": group_medians(tail)}
    cpu = f"{cpu_name()}, {cores()} cores"
    summary = summarize(timings)
    print(f"\n{cpu}; SmolLM2 fp32; {len(timings)} requests of {args.conversations} Mooncake conversations over "
          f"{args.duration_s:g} s; `strata serve --workers {args.workers}` {args.strata_args}".rstrip())  # fmt: skip
    print(
        f"client TTFT p50 {summary['ttft_p50_s']} s, p90 {summary['ttft_p90_s']} s; {len(rows)} requests traced"
    )
    header = (
        f"{'group (medians, ms)':22}{'TTFT':>8}"
        + "".join(f"{p:>10}" for p in PHASES)
        + f"{'uncached':>10}{'chunks':>8}"
    )
    print(header)
    for name, g in groups.items():
        print(f"{name:22}{g['ttft_ms']:>8.1f}" + "".join(f"{g[p]:>10.1f}" for p in PHASES)
              + f"{g['uncached_tokens']:>10.0f}{g['chunks']:>8.0f}")  # fmt: skip
    print("slowest requests:")
    for r in rows[-args.slowest :][::-1]:
        print(f"  {r.request_id[:8]} on {r.worker}: TTFT {r.ttft_ms:.0f} ms, {r.prompt_tokens} tokens "
              f"({r.cached_tokens} cached), {r.chunks} chunks; "
              + ", ".join(f"{p} {getattr(r, p):.0f}" for p in PHASES))  # fmt: skip
    out = {"bench": "ttft_breakdown", "cpu": cpu, "workers": args.workers, "requests": len(timings)}
    out |= {"traced": len(rows), "client": summary, "groups": groups}
    out |= {"slowest": [asdict(r) for r in rows[-args.slowest :][::-1]]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
