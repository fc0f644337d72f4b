"""The peers' figures: prefill, decode, concurrency and repeated-prompt measurements against an OpenAI server,
sampled in turns over several servers that are all up, each sample once the servers' processes are quiet."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

import httpx
import psutil

from harness.load import StreamTiming, stream_completion, stream_together

VOCAB_LOW, VOCAB_HIGH = 100, 40_000  # plain-text token ids, far from special tokens


class Workload:
    """The measurements, against one OpenAI server at `url` (model name "smollm2")."""

    def __init__(self, url: str, rng: random.Random) -> None:
        self.url = url
        self.rng = rng
        self.client = httpx.Client(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=64))

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

    def stream(self, prompt: list[int], max_tokens: int) -> StreamTiming:
        timing = StreamTiming(time.perf_counter())
        stream_completion(self.client, self.url, prompt, max_tokens, timing)
        if timing.error or timing.first_token is None:
            raise RuntimeError(f"{self.url}: {timing.error or 'no token streamed'}")
        return timing

    def together(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        """(wall seconds, generated tokens) for streams sent at once."""
        started = time.perf_counter()
        timings = stream_together(self.client, self.url, prompts, max_tokens)
        return time.perf_counter() - started, sum(t.completion_tokens for t in timings)

    def warm_up(self) -> None:
        self.stream(self.tokens(64), 4)

    def prefill(self, length: int) -> float:
        """Prompt tokens/s of one fresh prompt."""
        return length / self._ttft(self.stream(self.tokens(length), 1))

    def decode(self) -> float:
        """Tokens/s of one stream: 1 / its median inter-token gap."""
        chunks = self.stream(self.tokens(256), 64).chunk_times
        return 1 / statistics.median(b - a for a, b in zip(chunks, chunks[1:], strict=False))

    def concurrent(self, streams: int) -> float:
        wall, generated = self.together([self.tokens(256) for _ in range(streams)], 64)
        return generated / wall

    def repeated(self) -> float:
        """TTFT of a 2048-token prompt the second time it is sent."""
        prompt = self.tokens(2048)
        self.stream(prompt, 1)
        return self._ttft(self.stream(prompt, 1))

    def samples(self) -> list[tuple[str, Callable[[], float]]]:
        """(metric, one sample of it), in the order they are measured."""
        return [
            *((f"prefill_{n}_tok_s", lambda n=n: self.prefill(n)) for n in (128, 512, 2048)),
            ("decode_b1_tok_s", self.decode),
            *((f"concurrent_{n}_tok_s", lambda n=n: self.concurrent(n)) for n in (8, 32)),
            ("repeated_2048_ttft_s", self.repeated),
        ]

    def run(self, reps: int) -> dict[str, float]:
        """Every metric's median over `reps` samples, against this server alone."""
        return interleaved({"only": self}, reps)["only"]

    @staticmethod
    def _ttft(timing: StreamTiming) -> float:
        return timing.first_token - timing.submitted


def wait_quiet(pids: Sequence[int], cores: float = 0.1, window_s: float = 0.2, limit_s: float = 10.0) -> None:
    """Wait until the process trees of `pids` use under `cores` CPU over a window: vLLM's engine keeps one core
    spinning for about a second after its last step, which would slow the next server's sample."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        procs = []
        for pid in pids:
            try:
                parent = psutil.Process(pid)
                procs += [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        before = {p: _cpu_seconds(p) for p in procs}
        time.sleep(window_s)  # CPU time is only read by sampling: no event to wait on
        if sum(_cpu_seconds(p) - used for p, used in before.items()) / window_s < cores:
            return


def _cpu_seconds(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
        return times.user + times.system
    except psutil.NoSuchProcess:
        return 0.0


def interleaved(
    workloads: dict[str, Workload], reps: int, pids: Sequence[int] = ()
) -> dict[str, dict[str, float]]:
    """Medians per server and metric; each sample is taken on every server in turn, the order reversed every
    rep (A B, B A, ...), each once the servers' processes (`pids`) are quiet. The workloads' generators start from
    one seed, so each server is sent the same prompts."""
    for workload in workloads.values():
        workload.warm_up()
    order = list(workloads)
    plans = {name: workload.samples() for name, workload in workloads.items()}
    results: dict[str, dict[str, float]] = {name: {} for name in workloads}
    for index, (metric, _) in enumerate(plans[order[0]]):
        values: dict[str, list[float]] = {name: [] for name in workloads}
        for rep in range(reps):
            for name in order if rep % 2 == 0 else reversed(order):
                wait_quiet(pids)
                values[name].append(plans[name][index][1]())
        for name in workloads:
            results[name][metric] = statistics.median(values[name])
    return results
