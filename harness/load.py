"""Client load on an OpenAI server: streamed /v1/completions with token-id prompts, each request's timings, a
schedule of arrivals driven one thread per request, and the summary of a run."""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from harness.stats import percentile
from harness.trace import compression


@dataclass(slots=True)
class StreamTiming:
    """One streamed request; times are time.perf_counter() seconds."""

    submitted: float
    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finished: float | None = None
    error: str | None = None
    response_id: str = ""  # "cmpl-<request id>": the router's decision log names the request by it


def stream_completion(
    client: httpx.Client,
    url: str,
    prompt: list[int],
    max_tokens: int,
    timing: StreamTiming,
    cache_salt: str | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """One greedy streamed completion of model "smollm2" with ignore_eos; fills `timing` (first token, chunk
    times, usage) or its error. `cache_salt` (vLLM's field, Strata's too) keeps its KV blocks apart from those of
    requests with another salt; `extra`: more body fields (logprobs, ...)."""
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
    body.update(extra or {})
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {response.read()[:200]!r}"
                return
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    _read_chunk(json.loads(line[6:]), timing)
    except httpx.HTTPError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        timing.finished = time.perf_counter()


def stream_together(
    client: httpx.Client,
    url: str,
    prompts: list[list[int]],
    max_tokens: int,
    extra: dict[str, Any] | None = None,
) -> list[StreamTiming]:
    """Stream every prompt at once (a thread each) and wait for all; RuntimeError naming the server and the first
    error if any failed."""
    timings = [StreamTiming(time.perf_counter()) for _ in prompts]
    threads = [
        threading.Thread(
            target=stream_completion, args=(client, url, p, max_tokens, t), kwargs={"extra": extra}
        )
        for p, t in zip(prompts, timings, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [t.error for t in timings if t.error]
    if errors:
        raise RuntimeError(f"{url}: {errors[0]}")
    return timings


def _read_chunk(chunk: dict[str, Any], timing: StreamTiming) -> None:
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
        timing.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def drive(
    url: str,
    prompts: list[tuple[float, list[int], int]],
    duration_s: float | None = None,
    cache_salt: str | None = None,
) -> list[StreamTiming]:
    """Send each (arrival_s, prompt, max_tokens) at its arrival time, compressed to span `duration_s` if given
    (trace.compression), one thread each, and wait for every answer; every request with `cache_salt` (a replay
    repeated on a warm server starts cold again)."""
    speedup = 1.0 if duration_s is None else compression(prompts[-1][0], duration_s)
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


def summarize(timings: list[StreamTiming]) -> dict[str, Any]:
    """A run's figures: TTFT p50/p90 (s), ITL p50 (ms, gaps between streamed chunks of one request), latency p50
    (s), output tokens/s (first submit to last finish), prefix-hit rate (cached / prompt tokens), errors."""
    ok = [t for t in timings if t.error is None and t.first_token is not None]
    ttft = [t.first_token - t.submitted for t in ok]
    latency = [t.finished - t.submitted for t in ok]
    gaps = [b - a for t in ok for a, b in itertools.pairwise(t.chunk_times)]
    makespan = max(t.finished for t in timings) - min(t.submitted for t in timings)
    prompt = sum(t.prompt_tokens for t in ok)
    return {
        "requests": len(timings),
        "errors": len(timings) - len(ok),
        "ttft_p50_s": round(percentile(ttft, 50), 3),
        "ttft_p90_s": round(percentile(ttft, 90), 3),
        "itl_p50_ms": round(percentile(gaps, 50) * 1000, 1),
        "latency_p50_s": round(percentile(latency, 50), 3),
        "throughput_tok_s": round(sum(t.completion_tokens for t in ok) / makespan, 2),
        "hit_rate": round(sum(t.cached_tokens for t in ok) / max(1, prompt), 4),
        "first_errors": [t.error for t in timings if t.error][:3],
    }
