"""NVIDIA's aiperf replaying a Mooncake trace slice against vLLM's OpenAI server and Strata's, in turns.

    .venv/bin/python bench/aiperf_replay.py --aiperf .venv-aiperf/bin/aiperf --vllm-python .venv-vllm/bin/python \
        [--reps 2] [--plot PNG]

aiperf 0.13 (`pip install aiperf==0.13.0` in a venv of its own) is the client, not Strata's own replay: the trace
slice is requests [--start, --start + --requests) of bench/data/mooncake/conversation_trace.jsonl, a window that
no other bench replays, with each hash id a block of --block-tokens tokens (aiperf's --isl-block-size: requests
sharing leading ids share a prefix), outputs of --output-tokens, and timestamps compressed into --duration-s,
sent on aiperf's fixed schedule (`--custom-dataset-type mooncake_trace --fixed-schedule`) over streamed
/v1/completions with `ignore_eos` (aiperf's default leaves it out, and at the default temperature a sampled EOS
ends a request early, or at once: aiperf counts an empty stream as an error; --no-ignore-eos sends aiperf's
default). Both servers serve SmolLM2 from the same HF folder in --dtype with 2 threads and prefix caching;
aiperf tokenizes with that folder's tokenizer, offline: aiperf takes only a hub id, so the tokenizer's files are
laid out as the hub cache of a model "local/smollm2" in a scratch HF_HOME.

Each rep runs vLLM, then Strata, each on a fresh server (vLLM first in even reps, Strata first in odd ones).
Reported per system, medians over reps: TTFT p50/p90, ITL p50, request latency p50, output tokens/s, from aiperf's
own export (profile_export_aiperf.json); ratios are vLLM / Strata for times (>= 1: Strata ahead). Prints a table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from harness.servers import strata_openai, use_run_secret, vllm_server  # noqa: E402
from harness.trace import add_trace_flags, read_trace  # noqa: E402
from server.engine.config import DEFAULT_MODEL  # noqa: E402
from server.engine.loader import prepare_model  # noqa: E402

# (aiperf's metric tag, its statistic, our name); times in ms as aiperf reports them
METRICS = (
    ("time_to_first_token", "p50", "ttft_p50_ms"),
    ("time_to_first_token", "p90", "ttft_p90_ms"),
    ("inter_token_latency", "p50", "itl_p50_ms"),
    ("request_latency", "p50", "latency_p50_ms"),
    ("output_token_throughput", "avg", "output_tok_s"),
)


def trace_slice(args: argparse.Namespace, path: Path) -> int:
    """Write the slice in aiperf's mooncake_trace format; returns its number of prompt blocks."""
    rows = read_trace()[args.start : args.start + args.requests]
    first, last = rows[0]["timestamp"], rows[-1]["timestamp"]
    scale = args.duration_s * 1000 / max(last - first, 1)
    with path.open("w") as out:
        for row in rows:
            ids = row["hash_ids"][: args.max_blocks]
            out.write(json.dumps({
                "timestamp": round((row["timestamp"] - first) * scale),
                "input_length": len(ids) * args.block_tokens,
                "output_length": args.output_tokens,
                "hash_ids": ids,
            }) + "\n")  # fmt: skip
    return sum(min(len(r["hash_ids"]), args.max_blocks) for r in rows)


def hub_cache(folder: Path, home: Path) -> str:
    """The tokenizer files of `folder` as the hub cache entry of "local/smollm2" under `home` (HF_HOME)."""
    entry = home / "hub" / "models--local--smollm2"
    revision = "0" * 40
    snapshot = entry / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(revision)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "special_tokens_map.json"):
        if (folder / name).exists():
            (snapshot / name).write_bytes((folder / name).read_bytes())
    return "local/smollm2"


def run_aiperf(args: argparse.Namespace, url: str, trace: Path, hf_home: Path, out: Path) -> dict[str, float]:
    command = [
        args.aiperf, "profile", "--model", "smollm2", "--tokenizer", "local/smollm2", "--url", url,
        "--endpoint-type", "completions", "--streaming", "--input-file", str(trace),
        "--custom-dataset-type", "mooncake_trace", "--isl-block-size", str(args.block_tokens), "--fixed-schedule",
        "--ui-type", "none", "--output-artifact-dir", str(out), "--random-seed", "1",
    ]  # fmt: skip
    if args.ignore_eos:
        command += ["--extra-inputs", "ignore_eos:true"]
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=args.duration_s * 4 + 600
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise RuntimeError(
            f"aiperf failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    exports = list(out.rglob("profile_export_aiperf.json"))
    if not exports:
        raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json under {out}")
    found = parse_export(json.loads(exports[0].read_text()))
    # the client shares the machine's cores with the server: its CPU time, for the report
    found["client_cpu_s"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    records = list(out.rglob("profile_export.jsonl"))
    found["samples"] = per_request(records[0]) if records else {}  # type: ignore[assignment]
    return found


def per_request(path: Path) -> dict[str, list[float]]:
    """Each request's TTFT and ITL (ms) from aiperf's per-record export, for the CDFs of --plot."""
    samples: dict[str, list[float]] = {"time_to_first_token": [], "inter_token_latency": []}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        metrics = record.get("metrics", record)
        for tag, values in samples.items():
            value = metrics.get(tag)
            if isinstance(value, dict):
                value = value.get("value")
            if isinstance(value, (int, float)):
                values.append(float(value))
    return samples


def plot(results: dict[str, list[dict]], path: Path) -> None:
    """CDFs of TTFT and ITL per system, every rep's requests pooled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, (tag, label) in zip(
        axes, (("time_to_first_token", "TTFT, ms"), ("inter_token_latency", "ITL, ms")), strict=True
    ):
        for system, runs in results.items():
            values = sorted(v for run in runs for v in run.get("samples", {}).get(tag, []))
            if values:
                axis.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=system)
        axis.set_xscale("log")
        axis.set_xlabel(label)
        axis.set_ylabel("share of requests")
        axis.grid(True, which="both", linewidth=0.3)
        axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def parse_export(export: dict) -> dict[str, float]:
    """Our metrics from aiperf's JSON export: a record per metric tag with its statistics."""
    records = export.get("records", export)
    found: dict[str, float] = {}
    for tag, stat, name in METRICS:
        record = records.get(tag) if isinstance(records, dict) else None
        if record is None or record.get(stat) is None:
            raise RuntimeError(f"aiperf's export has no {tag}.{stat}: {sorted(records)[:20]}")
        found[name] = float(record[stat])
    count = records.get("request_count", {})
    found["requests"] = float(count.get("avg", 0.0)) if isinstance(count, dict) else float(count)
    errors = export.get("error_summary") or []
    found["errors"] = float(sum(e.get("count", 0) for e in errors)) if isinstance(errors, list) else 0.0
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--aiperf", required=True, help="the aiperf command of its venv")
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), required=False)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--start", type=int, default=6000, help="first request of the slice (trace order)")
    parser.add_argument("--requests", type=int, default=128)
    add_trace_flags(parser, block_tokens=16, max_blocks=64, duration_s=90.0)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every output --output-tokens long",
    )
    parser.add_argument("--strata-args", default="", help="more `strata serve` flags")
    parser.add_argument("--keep", type=Path, default=None, help="copy aiperf's artifacts of every run here")
    parser.add_argument("--plot", type=Path, default=None, help="write the TTFT and ITL CDFs (PNG) here")
    args = parser.parse_args()
    args.aiperf = os.path.abspath(args.aiperf)
    use_run_secret()
    folder = prepare_model(DEFAULT_MODEL).folder
    results: dict[str, list[dict[str, float]]] = {"vllm": [], "strata": []}
    with tempfile.TemporaryDirectory(prefix="aiperf-replay-") as scratch:
        tmp = Path(scratch)
        blocks = trace_slice(args, tmp / "trace.jsonl")
        hub_cache(folder, tmp / "hf")
        for rep in range(args.reps):
            order = ["vllm", "strata"] if rep % 2 == 0 else ["strata", "vllm"]
            for system in order if args.vllm_python else ["strata"]:
                servers = (
                    vllm_server(args.vllm_python, folder, args.dtype, args.threads)
                    if system == "vllm"
                    else strata_openai(args.dtype, args.threads, args.strata_args.split())
                )
                with servers as server:
                    out = tmp / f"{system}-{rep}"
                    results[system].append(run_aiperf(args, server.url, tmp / "trace.jsonl", tmp / "hf", out))
                shown = {k: v for k, v in results[system][-1].items() if k != "samples"}
                print(f"rep {rep} {system}: {shown}", flush=True)
                if args.keep is not None:
                    shutil.copytree(out, args.keep / out.name, dirs_exist_ok=True)
    if args.plot is not None:
        plot(results, args.plot)
    for runs in results.values():
        for run in runs:
            run.pop("samples", None)
    report(results, args, blocks)


def report(results: dict[str, list[dict[str, float]]], args: argparse.Namespace, blocks: int) -> None:
    medians = {
        system: {name: statistics.median(run[name] for run in runs) for name in runs[0]}
        for system, runs in results.items()
        if runs
    }
    scale = (
        f"aiperf 0.13, Mooncake conversation trace requests {args.start}-{args.start + args.requests - 1} "
        f"({blocks} blocks of {args.block_tokens} tokens, outputs {args.output_tokens}"
        f"{', ignore_eos' if args.ignore_eos else ''}) on a fixed schedule "
        f"over {args.duration_s:.0f} s; SmolLM2 {args.dtype}, {args.threads} threads; medians of {args.reps}"
    )
    print(scale)
    print(f"{'metric':<16} {'vllm':>10} {'strata':>10} {'ratio':>8}")
    ratios = {}
    for _, _, name in METRICS:
        ours = medians["strata"][name]
        theirs = medians.get("vllm", {}).get(name, float("nan"))
        ratio = ours / theirs if name.endswith("tok_s") else theirs / ours
        ratios[name] = round(ratio, 3)
        print(f"{name:<16} {theirs:>10.1f} {ours:>10.1f} {ratio:>7.2f}x")
    print(json.dumps({"bench": "aiperf_replay", "scale": scale, "medians": medians, "ratios": ratios}))


if __name__ == "__main__":
    main()
