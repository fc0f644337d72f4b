"""One workload through several servers on the same CPU, driven by the same client, one after the other or (with
--interleave) all up at once with each sample taken on every server in turn:

    (a) vllm            vLLM's own OpenAI server (its venv's `vllm.entrypoints.openai.api_server`), both cores
    (a1) vllm-1core     the same server on one core: the hardware each of (c)'s two workers has
    (b) strata-vllm-1   `strata serve` with a backend "vllm" model on one vLLM worker
    (c) strata-vllm-2   the same on two vLLM workers, KV-aware routing from vLLM's KV events
    (d) strata-2        `strata serve --workers 2` on Strata's own engine
    (e) strata-1        `strata serve` on one in-process Strata engine (both cores)
    a name ending in -kvbm (strata-vllm-2-kvbm): the same with the node's G2 (--g2-gib) below every worker, else
                        Strata runs with --no-kvbm

    .venv/bin/python bench/engines.py --vllm-python .venv-vllm/bin/python [--reps 1] [--duration-s 90]

The workload: bench/peers.py's figures (harness/figures.py: prefill of 128/512/2048-token prompts, decode at
batch 1, 8 and 32 concurrent streams, a repeated 2048-token prompt), then the Mooncake conversation replay of
`bench/routing_replay_serve.py` (token-id prompts, one trace hash id = --block-tokens tokens, arrivals compressed
to --duration-s).
Every engine runs SmolLM2 from the same HF folder in the same dtype, prefix caching on, KV blocks of
--block-tokens (vLLM on CPU needs a multiple of 32). Threads: one engine uses both cores (a, b, e); two workers
use one each, as `strata serve` splits the cores by default (c: each vLLM worker's process tree on a core of its
own; d: one thread per worker). These thread counts are set for a 2-core machine; the first line of the output
names the CPU and the cores this run had.

Ratios against (a): the issue's goals are (b) within 5 % of (a) on TTFT p50 and throughput, and (c) ahead of (a)
on the replay's TTFT p50. On 2 cores (c)'s two workers share the hardware (a) has alone, a core each; with (a1) in
the run, ratios against it follow: the comparison of two workers with one of the same size, as two GPUs behind
Strata against vLLM on one. Prints the tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from bench.machine import machine  # noqa: E402
from harness.figures import Workload, interleaved, wait_quiet  # noqa: E402
from harness.load import drive, summarize  # noqa: E402
from harness.servers import Server, smollm2_repository, start_strata, use_run_secret, vllm_server  # noqa: E402
from harness.trace import add_trace_flags, trace_prompts  # noqa: E402
from kvbm.host_pool import remove_segments  # noqa: E402
from server.engine.config import DEFAULT_MODEL  # noqa: E402
from server.engine.loader import prepare_model  # noqa: E402

CONFIGS = ("vllm", "vllm-1core", "strata-vllm-1", "strata-vllm-2", "strata-2", "strata-1")
VLLM_CONFIG = 'backend: "vllm"\ninstance_group [ { count: %d kind: KIND_MODEL } ]\n'


def vllm_repository(root: Path, folder: Path, workers: int, args: argparse.Namespace) -> Path:
    """A repository with one Triton vLLM-backend model named smollm2 (what the client asks for)."""
    model = root / "repository" / "smollm2"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(VLLM_CONFIG % workers)
    engine_args = {
        "model": str(folder), "dtype": args.dtype, "max_model_len": 4096, "block_size": args.block_tokens,
        "enable_prefix_caching": True, "kv_cache_memory_bytes": args.kv_bytes, "max_num_batched_tokens": 2048,
    }  # fmt: skip
    (model / "1" / "model.json").write_text(json.dumps(engine_args, indent=2))
    return root / "repository"


# SmolLM2-135M's KV bytes per token in fp32: 30 layers x (K, V) x 3 kv heads x 64 dims x 4 bytes
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


def strata_repository(root: Path, args: argparse.Namespace, threads: int) -> Path:
    """Strata's engine with the same KV bytes and block size as the vLLM engines, `threads` per engine."""
    return smollm2_repository(
        root,
        block_size=args.block_tokens,
        num_kv_blocks=args.kv_bytes // (args.block_tokens * SMOLLM2_KV_BYTES_PER_TOKEN),
        num_threads=threads,
        max_num_batched_tokens=2048,
        dtype=args.dtype,
    )


@contextmanager
def environment(**values: str):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def measure(url: str, args: argparse.Namespace, prompts: list) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if not args.replay_only:
        result.update(Workload(url, random.Random(1)).run(args.reps))
    return result | replay(url, args, prompts)


def replay(
    url: str, args: argparse.Namespace, prompts: list, cache_salt: str | None = None
) -> dict[str, Any]:
    """The conversation replay's figures, named replay_*."""
    summary = summarize(drive(url, prompts, args.duration_s, cache_salt))
    result = {f"replay_{key}": value for key, value in summary.items() if key != "first_errors"}
    if summary["errors"]:
        result["replay_first_errors"] = summary["first_errors"]
    return result


def run_config(name: str, args: argparse.Namespace, folder: Path, prompts: list) -> dict[str, Any]:
    with serving(name, args, folder) as server:
        return measure(server.url, args, prompts)


@contextmanager
def serving(name: str, args: argparse.Namespace, folder: Path) -> Iterator[Server]:
    """The server of configuration `name`, up until the block ends."""
    if name in ("vllm", "vllm-1core"):  # vLLM's OpenAI server, its threads bound
        threads = 1 if name == "vllm-1core" else 2
        flags = ["--block-size", str(args.block_tokens), "--kv-cache-memory-bytes", str(args.kv_bytes)]
        # else its usage never reports cached_tokens (hit rate 0)
        flags.append("--enable-prompt-tokens-details")
        with vllm_server(args.vllm_python, folder, args.dtype, threads, flags) as server:
            yield server
        return
    with tempfile.TemporaryDirectory(prefix=f"strata-engines-{name}-") as tmp:
        root = Path(tmp)
        flags = ["--no-kvbm"]
        if name.endswith("-kvbm"):  # the node's G2 under every worker (StrataKVConnector for vLLM)
            name = name.removesuffix("-kvbm")
            flags = ["--kvbm-host-cache-gb", str(args.g2_gib), "--kvbm-cache-id", root.name]
        if name == "strata-2":
            repository, env = strata_repository(root, args, threads=1), {}
            flags += ["--workers", "2"]
        elif name == "strata-1":
            repository, env = strata_repository(root, args, threads=2), {}
        else:
            workers = int(name.rsplit("-", 1)[1])
            repository = vllm_repository(root, folder, workers, args)
            env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1"} if workers == 1 else {}  # several: Strata binds each
            flags += ["--vllm-python", args.vllm_python]
        with environment(**env):
            server = start_strata(
                repository, root / "run", *flags, *args.strata_args.split(), ready_timeout_s=900
            )
        try:
            yield Server(server.openai_url, server.process.pid)
        finally:
            server.stop()
            remove_segments(root.name)


def run_interleaved(names: list[str], args: argparse.Namespace, folder: Path, prompts: list) -> dict:
    """Every server up at once: peers' figures sample by sample in turns (harness.figures.interleaved), then
    each replay in turn, once the others are quiet, --replay-reps times (the order reversed every rep; each rep
    under a cache salt of its own, so that it starts as cold as the first): medians."""
    with ExitStack() as stack:
        servers = {name: stack.enter_context(serving(name, args, folder)) for name in names}
        pids = [server.pid for server in servers.values()]
        results: dict[str, dict[str, Any]] = {name: {} for name in names}
        if not args.replay_only:
            workloads = {name: Workload(server.url, random.Random(1)) for name, server in servers.items()}
            for name, figures in interleaved(workloads, args.reps, pids).items():
                results[name].update(figures)
        replays: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for rep in range(args.replay_reps):
            for name in names if rep % 2 == 0 else reversed(names):
                wait_quiet(pids)
                salt = f"replay-{rep}" if rep else None
                replays[name].append(replay(servers[name].url, args, prompts, salt))
                print(f"{name} replay {rep}: {replays[name][-1]}", file=sys.stderr, flush=True)
        for name, runs in replays.items():
            for key, value in runs[0].items():
                numbers = [run[key] for run in runs if isinstance(run.get(key), int | float)]
                results[name][key] = statistics.median(numbers) if len(numbers) == len(runs) else value
    return results


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace, scale: str) -> None:
    keys = [
        k for k in next(iter(results.values())) if isinstance(next(iter(results.values()))[k], int | float)
    ]
    print(f"engines side by side: {scale}")
    header = f"{'metric':<28}" + "".join(f"{name:>16}" for name in results)
    print(header)
    for key in keys:
        cells = "".join(f"{row.get(key, float('nan')):>16.3f}" for row in results.values())
        print(f"{key:<28}{cells}")
    for base_name in ("vllm", "vllm-1core"):
        base = results.get(base_name)
        if not base:
            continue
        print(f"ratios to {base_name}, >= 1.0 is better than vLLM's own server on those cores:")
        for key in keys:
            if key in ("replay_requests", "replay_errors", "replay_hit_rate"):
                continue
            lower_better = key.endswith("_s") and not key.endswith("tok_s") or key.endswith("_ms")
            cells = ""
            for row in results.values():
                ours, theirs = row.get(key), base.get(key)
                ratio = (
                    (theirs / ours if lower_better else ours / theirs) if ours and theirs else float("nan")
                )
                cells += f"{ratio:>16.2f}"
            print(f"{key:<28}{cells}")
    print(json.dumps({"bench": "engines", "scale": scale, "machine": machine(), "results": results}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-python", default=os.environ.get("STRATA_VLLM_PYTHON"), required=False)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--kv-bytes", type=int, default=512 << 20, help="KV pool per engine")
    parser.add_argument(
        "--replay-only", action="store_true", help="skip the prefill/decode/concurrent figures"
    )
    add_trace_flags(  # --block-tokens is every engine's KV block size too (vLLM on CPU: a multiple of 32)
        parser, conversations=12, min_turns=3, max_output=16, max_blocks=24, block_tokens=32, duration_s=90.0
    )
    parser.add_argument(
        "--strata-args",
        default="",
        help="more `strata serve` flags for every Strata configuration, e.g. '--router-overlap-weight 16'",
    )
    parser.add_argument(
        "--replay-reps", type=int, default=1, help="with --interleave: replays per server, medians"
    )
    parser.add_argument("--g2-gib", type=float, default=1.0, help="G2 of the *-kvbm configurations")
    parser.add_argument(
        "--interleave", action="store_true", help="all servers up at once, figures sampled in turns"
    )
    args = parser.parse_args()
    if not args.vllm_python:
        parser.error("--vllm-python (or STRATA_VLLM_PYTHON): the Python of a venv with vLLM (make vllm)")
    use_run_secret()
    folder = prepare_model(DEFAULT_MODEL).folder
    prompts, _oracle, _sources = trace_prompts(args)
    run_on = machine()
    scale = (
        f"{run_on['cpu']}, {run_on['cores']} cores; SmolLM2 {args.dtype}; threads: 2 for vllm, strata-vllm-1 and "
        f"strata-1, 1 for vllm-1core and each strata-2 worker, strata-vllm-2's workers as strata serve splits the "
        f"cores; KV {args.kv_bytes >> 20} MiB and blocks of {args.block_tokens} tokens per "
        f"engine, medians of {args.reps}; replay: {len(prompts)} requests of {args.conversations} Mooncake "
        f"conversations (>= {args.min_turns} turns, <= {args.max_blocks} blocks, outputs <= {args.max_output}) "
        f"over {args.duration_s:g} s"
        + (f", medians of {args.replay_reps}" if args.replay_reps > 1 else "")
        + (f"; Strata with {args.strata_args}" if args.strata_args else "")
    )
    names = args.configs.split(",")
    if args.interleave:
        results = run_interleaved(names, args, folder, prompts)
    else:
        results = {}
        for name in names:
            results[name] = run_config(name, args, folder, prompts)
            print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    report(results, args, scale + (", all servers up, samples interleaved" if args.interleave else ""))


if __name__ == "__main__":
    main()
