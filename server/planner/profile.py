"""`strata profile`: what one worker of a model does on this hardware, for the planner (sizing.WorkerProfile).

The engine is built as `strata worker` builds it (the model's model.json with the same engine flags) and runs
in this process, alone:

    prefill   TTFT of one request per prompt length (median of `repeats`, each prompt new to the cache)
    decode    ITL with `c` streams decoding together at each context length: the streams share one prompt
              of that length (prefilled once, so the profile takes minutes, not hours) plus a token of their
              own, and generate `decode_tokens` each; ITL is the median over the streams of
              (last token time - first token time) / (tokens - 1)

The JSON file (`save`/`load`) is what `strata planner --profile` reads.
"""

from __future__ import annotations

import itertools
import queue
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import msgspec

from server.engine.api import GenerationOutput, GenerationRequest, LocalEngine, RequestId, SamplingParams
from server.planner.sizing import DecodePoint, PrefillPoint, WorkerProfile

_ids = itertools.count()


def profile_worker(
    engine: LocalEngine,
    prompt_lengths: Sequence[int] = (128, 512, 1024, 2048),
    concurrencies: Sequence[int] = (1, 4, 8, 16),
    contexts: Sequence[int] = (256, 1024),
    decode_tokens: int = 24,
    repeats: int = 3,
) -> WorkerProfile:
    limit = engine.max_model_len - decode_tokens - 2
    prefill = tuple(
        PrefillPoint(n, statistics.median(_ttft(engine, n) for _ in range(repeats)))
        for n in prompt_lengths
        if n <= limit
    )
    decode = tuple(
        DecodePoint(c, n, _itl(engine, c, n, decode_tokens))
        for n in contexts
        if n <= limit
        for c in concurrencies
        if c <= engine.resources.max_concurrent_requests
    )
    return WorkerProfile(prefill, decode)


def _prompt(length: int) -> list[int]:
    """`length` token ids no other profile prompt starts with (the prefix cache must not help)."""
    start = next(_ids) * 7919
    return [1 + (start + j) % 30000 for j in range(length)]


def _ttft(engine: LocalEngine, prompt_tokens: int) -> float:
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.monotonic()
    engine.submit(
        GenerationRequest(RequestId(f"profile-{next(_ids)}"), _prompt(prompt_tokens), sampling), outputs.put
    )
    while not outputs.get(timeout=600).finished:
        pass
    return time.monotonic() - started


def _itl(engine: LocalEngine, concurrency: int, context: int, decode_tokens: int) -> float:
    shared = _prompt(context - 1)
    sampling = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    for i in range(concurrency):
        request = GenerationRequest(RequestId(f"profile-{next(_ids)}"), [*shared, 30001 + i], sampling)
        engine.submit(request, outputs.put)
    first: dict[str, float] = {}
    itls: list[float] = []
    tokens: dict[str, int] = {}
    while len(itls) < concurrency:
        output = outputs.get(timeout=600)
        now = time.monotonic()
        tokens[output.request_id] = tokens.get(output.request_id, 0) + len(output.new_token_ids)
        first.setdefault(output.request_id, now)
        if output.finished:
            itls.append((now - first[output.request_id]) / max(tokens[output.request_id] - 1, 1))
    return statistics.median(itls)


def save(profile: WorkerProfile, path: Path) -> None:
    path.write_bytes(msgspec.json.format(msgspec.json.encode(asdict(profile))))


def load(path: Path) -> WorkerProfile:
    """The profile at `path`; ValueError naming the file and what is wrong with it."""
    try:
        raw = msgspec.json.decode(path.read_bytes(), type=_ProfileFile)
        return WorkerProfile(
            tuple(PrefillPoint(p.prompt_tokens, p.ttft_s) for p in raw.prefill),
            tuple(DecodePoint(d.concurrency, d.context_tokens, d.itl_s) for d in raw.decode),
        )
    except OSError as exc:
        raise ValueError(f"--profile {path}: {exc.strerror}") from exc
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise ValueError(
            f"--profile {path}: not a worker profile ({exc}); write one with `strata profile`"
        ) from exc


def table(profile: WorkerProfile) -> str:
    lines = ["prefill: prompt tokens -> TTFT ms (one request alone)"]
    lines += [f"  {p.prompt_tokens:>6} -> {p.ttft_s * 1000:8.1f}" for p in profile.prefill]
    lines.append("decode: streams x context tokens -> ITL ms (tokens/s of the worker)")
    lines += [
        f"  {d.concurrency:>3} x {d.context_tokens:>5} -> {d.itl_s * 1000:7.1f} ({d.concurrency / d.itl_s:6.1f})"
        for d in profile.decode
    ]
    return "\n".join(lines)


class _Prefill(msgspec.Struct, forbid_unknown_fields=True):
    prompt_tokens: int
    ttft_s: float


class _Decode(msgspec.Struct, forbid_unknown_fields=True):
    concurrency: int
    context_tokens: int
    itl_s: float


class _ProfileFile(msgspec.Struct, forbid_unknown_fields=True):
    prefill: list[_Prefill]
    decode: list[_Decode]
