"""`python bench/routing.py replay-serve`: a slice of the Mooncake trace against `strata serve --workers N`, driven
over the OpenAI API exactly as a client would (streamed /v1/completions with token-id prompts).

Servers start through `tests.conftest.start_strata` (free ports, wait for readiness, SIGTERM at the end), as
bench/overhead.py does. For each tier setting (`--tiers g1,g2`: G1-only prefix caching, or G1 + the node's shared G2 host pool) and each
routing strategy, a fresh server starts from a private copy of the example repository (model.json rewritten with
the KV pool, block size and threads below), the requests arrive at their trace times compressed to `--duration-s`,
and the server is stopped. Fresh servers keep one run's cache from helping the next.

Per run: TTFT p50/p90 (submit -> first streamed token), ITL p50 (gaps between streamed chunks of one request),
throughput (output tokens / time from first submit to last finish), prefix-hit rate (the usage's
`prompt_tokens_details.cached_tokens` / prompt tokens), errors, and the router's decision counts from /metrics;
and where the oracle's hits were lost (`hit_losses`): by whether the request holding the prefix had produced its
first token, or finished, when the request that missed it was sent.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvbm.host_pool import remove_segments
from tests.conftest import copy_models, start_strata


@dataclass(slots=True)
class StreamTiming:
    submitted: float
    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finished: float | None = None
    error: str | None = None
    response_id: str = ""  # "cmpl-<request id>": the router's decision log names the request by it


def make_repository(root: Path, args: Any) -> Path:
    """A repository holding only smollm2, its model.json set for this benchmark."""
    repository = copy_models(root / "repository", "smollm2")
    model_json = repository / "smollm2" / "1" / "model.json"
    config = json.loads(model_json.read_text())
    config.update(
        block_size=args.block_tokens,
        num_kv_blocks=args.kv_blocks,
        num_threads=args.threads_per_worker,
        cache_dir=args.model_cache,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    config.pop("kv_cache_bytes", None)
    model_json.write_text(json.dumps(config, indent=2))
    return repository


def stream_completion(
    client: httpx.Client,
    url: str,
    prompt: list[int],
    max_tokens: int,
    timing: StreamTiming,
    cache_salt: str | None = None,
) -> None:
    """One streamed completion; fills `timing` (first token, chunk times, usage) or its error. `cache_salt`
    (vLLM's field, Strata's too) keeps its KV blocks apart from those of requests with another salt."""
    body: dict[str, Any] = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {response.read()[:200]!r}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                timing.response_id = chunk.get("id", timing.response_id)
                if chunk.get("choices"):
                    timing.chunk_times.append(now)
                    if timing.first_token is None:
                        timing.first_token = now
                usage = chunk.get("usage")
                if usage:
                    timing.prompt_tokens = usage["prompt_tokens"]
                    timing.completion_tokens = usage["completion_tokens"]
                    timing.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ) or 0
    except httpx.HTTPError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        timing.finished = time.perf_counter()


def drive(
    url: str,
    prompts: list[tuple[float, list[int], int]],
    duration_s: float,
    cache_salt: str | None = None,
) -> list[StreamTiming]:
    """Send each (arrival_s, prompt, max_tokens) at its arrival time compressed to `duration_s`, one thread each;
    every request with `cache_salt` (a replay repeated on a warm server starts cold again)."""
    last = prompts[-1][0] or 1.0
    speedup = max(1.0, last / duration_s)
    timings: list[StreamTiming] = []
    threads: list[threading.Thread] = []
    with httpx.Client(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=512)) as client:
        started = time.perf_counter()
        for arrival_s, prompt, max_tokens in prompts:
            delay = started + arrival_s / speedup - time.perf_counter()
            if delay > 0:
                time.sleep(delay)  # the trace's own arrival times
            timing = StreamTiming(time.perf_counter())
            timings.append(timing)
            thread = threading.Thread(
                target=stream_completion, args=(client, url, prompt, max_tokens, timing, cache_salt)
            )
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
    return timings


def router_decisions(url: str) -> dict[str, int]:
    """strata_router_decisions_total by strategy/reason, from the frontend's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    decisions = {}
    for match in re.finditer(r"^strata_router_decisions_total\{([^}]*)\} ([0-9.e+]+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        decisions[f"{labels.get('strategy')}/{labels.get('reason')}"] = int(float(match.group(2)))
    return decisions


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


def summarize(timings: list[StreamTiming]) -> dict[str, Any]:
    ok = [t for t in timings if t.error is None and t.first_token is not None]
    ttft = sorted(t.first_token - t.submitted for t in ok)
    latency = sorted(t.finished - t.submitted for t in ok)
    gaps = [b - a for t in ok for a, b in itertools.pairwise(t.chunk_times)]

    def pick(values: list[float], q: float) -> float:
        return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else float("nan")

    makespan = max(t.finished for t in timings) - min(t.submitted for t in timings)
    prompt = sum(t.prompt_tokens for t in ok)
    return {
        "requests": len(timings),
        "errors": len(timings) - len(ok),
        "ttft_p50_s": pick(ttft, 0.5),
        "ttft_p90_s": pick(ttft, 0.9),
        "itl_p50_ms": round(statistics.median(gaps) * 1000, 1) if gaps else float("nan"),
        "latency_p50_s": pick(latency, 0.5),
        "throughput_tok_s": round(sum(t.completion_tokens for t in ok) / makespan, 2),
        "hit_rate": round(sum(t.cached_tokens for t in ok) / max(1, prompt), 4),
        "first_errors": [t.error for t in timings if t.error][:3],
    }


_RUNS = itertools.count()  # numbers each run's G2 segment


def run_one(
    prompts: list[tuple[float, list[int], int]],
    sources: list[tuple[int, int]],
    strategy: str,
    tier: str,
    args: Any,
    log_name: str = "",
) -> dict[str, Any]:
    """One fresh `strata serve` replaying the slice; with --keep-logs its logs go to `log_name` (or
    `<strategy>-<tier>`) in that directory."""
    with tempfile.TemporaryDirectory(prefix="strata-replay-") as tmp:
        root = Path(tmp)
        name, _, weight = strategy.partition("@")  # kv-aware@4: --router-overlap-weight 4
        extra = ["--workers", str(args.workers)] + (["--router-overlap-weight", weight] if weight else [])
        if name == "kv-aware-in-flight":  # kv-aware, counting in-flight requests' blocks as held
            extra += ["--routing-strategy", "kv-aware", "--router-count-in-flight"]
        else:
            extra += ["--routing-strategy", name]
        if tier == "g1":
            extra.append("--no-kvbm")
        else:  # G2: the node's shared host pool, a fresh segment per run (a reused one would start warm)
            cache_id = f"replay-{os.getpid()}-{next(_RUNS)}"
            extra += ["--kvbm-host-cache-gb", str(args.host_cache_gb), "--kvbm-cache-id", cache_id]
        if args.keep_logs:
            extra += ["--log-verbose", "1"]  # the router's per-decision debug lines
        server = start_strata(make_repository(root, args), root, *extra)
        url = f"http://127.0.0.1:{server.openai_port}"
        try:
            timings = drive(url, prompts, args.duration_s)
            result = summarize(timings) | hit_losses(timings, sources, args.block_tokens)
            result["decisions"] = router_decisions(url)
        finally:
            server.stop()
            if tier != "g1":
                remove_segments(cache_id)
            if args.keep_logs:
                keep_logs(
                    Path(args.keep_logs) / (log_name or f"{strategy}-{tier}"),
                    server.log_path,
                    timings,
                    sources,
                )
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
