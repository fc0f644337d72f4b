"""Strata's KV tiers under vLLM (StrataKVConnector): what write-through costs and what reloading saves.

    .venv/bin/python bench/vllm_kvbm.py --vllm-python .venv-vllm/bin/python [--docs 8] [--doc-tokens 1900] [--reps 3]

Each configuration runs in a child process of the vLLM venv (`make vllm`): one VLLMEngine at a time on the same CPU, SmolLM2 fp32, blocks of 128 tokens,
a G1 pool of --g1-mib (about two documents):

    baseline   vLLM's own prefix cache only (no connector)
    null       a KV connector that moves nothing (bench/null_connector.py): the control for what
               StrataKVConnector's copies cost
    kvbm-g2    StrataKVConnector with a G2 host tier of --g2-gib

Pass 1 prefills each document once (cold: the connector's write-through is the only difference). Pass 2 asks
each document again, --reps times over: by then vLLM's pool has evicted it, so the baseline recomputes it and
kvbm-g2 loads its blocks from G2. Figures are medians of the time to first token (one token requested per prompt,
so TTFT is the prompt's prefill or load). Ratios are kvbm-g2 over baseline and over null. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvbm.config import KVBMConfig  # noqa: E402
from kvbm.host_pool import remove_segments  # noqa: E402
from server.engine.api import GenerationOutput, GenerationRequest, SamplingParams  # noqa: E402
from server.engine.config import DEFAULT_MODEL  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def first_token(engine, request_id: str, prompt_ids: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached prompt tokens) of a one-token request."""
    done, cached = threading.Event(), [0]

    def sink(output: GenerationOutput) -> None:
        cached[0] = output.num_cached_tokens
        if output.finished:
            done.set()

    start = time.perf_counter()
    engine.submit(
        GenerationRequest(request_id, prompt_ids, SamplingParams(max_tokens=1, temperature=0)), sink
    )
    if not done.wait(600):
        raise TimeoutError(request_id)
    return time.perf_counter() - start, cached[0]


def documents(engine, count: int, tokens: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        text = f"Document {i}. " + " ".join(
            f"Section {i}.{j} covers serving topic {j * 7 + i}." for j in range(400)
        )
        prompts.append(engine.encode(text)[:tokens])
    return prompts


def run(config: str, args: argparse.Namespace, folder: str) -> dict:
    """One configuration, in this (vLLM venv) process."""
    from server.vllm_engine.engine import VLLMEngine

    engine_args = {
        "model": str(folder), "dtype": "float32", "enforce_eager": True, "max_model_len": 2048,
        "kv_cache_memory_bytes": args.g1_mib << 20, "block_size": 128,
    }  # fmt: skip
    cache_id = f"bench-{uuid.uuid4().hex[:8]}"
    kvbm = (
        KVBMConfig(host_cache_gb=args.g2_gib, cache_id=cache_id, flush_budget_s=0)
        if config == "kvbm-g2"
        else None
    )
    if config == "null":
        from vllm.config import KVTransferConfig

        engine_args["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NullConnector", kv_connector_module_path="bench.null_connector", kv_role="kv_both"
        )
    engine = VLLMEngine(engine_args, worker_id=f"bench-{config}", kvbm=kvbm)
    try:
        prompts = documents(engine, args.docs, args.doc_tokens)
        first_token(engine, "warm-up", prompts[0][:200])
        cold = [first_token(engine, f"cold-{i}", p) for i, p in enumerate(prompts)]
        again = [
            first_token(engine, f"again-{rep}-{i}", p) for rep in range(args.reps) for i, p in enumerate(prompts)
        ]  # fmt: skip
    finally:
        engine.close()
        remove_segments(cache_id)
    tokens = len(prompts[0])
    return {
        "config": config,
        "prompt_tokens": tokens,
        "cold_ttft_s": statistics.median(t for t, _ in cold),
        "cold_prefill_tok_s": tokens / statistics.median(t for t, _ in cold),
        "again_ttft_s": statistics.median(t for t, _ in again),
        "again_cached_tokens": statistics.median(c for _, c in again),
    }


def child(config: str, args: argparse.Namespace, folder: str) -> dict:
    """Run one configuration under the vLLM venv; its log goes to stderr, its row comes back as JSON."""
    command = [args.vllm_python, __file__, "--child", config, folder, "--docs", str(args.docs)]
    command += ["--doc-tokens", str(args.doc_tokens), "--reps", str(args.reps), "--g1-mib", str(args.g1_mib)]
    command += ["--g2-gib", str(args.g2_gib)]
    # every configuration on the same cores: vLLM's CPU auto-binding reserves one more core when any connector
    # is attached (server/vllm_engine/engine.py, _keep_cpu_layout), which once made the connectors look faster
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": args.bind,
    }
    done = subprocess.run(command, stdout=subprocess.PIPE, env=env, text=True, timeout=1800, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=1900)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--g1-mib", type=int, default=200, help="vLLM's KV pool (fp32 SmolLM2: 5.6 MiB a block)"
    )
    parser.add_argument("--g2-gib", type=float, default=1.0)
    parser.add_argument(
        "--bind", default=f"0-{os.cpu_count() - 1}", help="VLLM_CPU_OMP_THREADS_BIND of every configuration"
    )
    parser.add_argument(
        "--vllm-python", help="the vLLM venv's interpreter (make vllm: .venv-vllm/bin/python)"
    )
    parser.add_argument("--order", default="baseline,null,kvbm-g2", help="which configuration runs first")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run(args.child[0], args, args.child[1])))
        return
    if not args.vllm_python:
        parser.error("--vllm-python is required (make vllm builds .venv-vllm)")
    from server.engine.loader import prepare_model

    folder = str(prepare_model(DEFAULT_MODEL).folder)
    rows = [child(config, args, folder) for config in args.order.split(",")]
    by_config = {row["config"]: row for row in rows}
    kvbm = by_config["kvbm-g2"]
    ratios = {
        f"{phase}_ttft_vs_{other}": kvbm[f"{phase}_ttft_s"] / by_config[other][f"{phase}_ttft_s"]
        for phase in ("cold", "again")
        for other in ("baseline", "null")
    }
    print(
        f"\n{'config':10} {'tokens':>6} {'cold TTFT s':>12} {'cold tok/s':>11} {'again TTFT s':>13} {'cached':>7}"
    )
    for row in rows:
        print(
            f"{row['config']:10} {row['prompt_tokens']:6d} {row['cold_ttft_s']:12.3f} {row['cold_prefill_tok_s']:11.0f}"
            f" {row['again_ttft_s']:13.3f} {row['again_cached_tokens']:7.0f}"
        )
    for name, ratio in ratios.items():
        print(f"kvbm-g2 {name.replace('_', ' ')}: x{ratio:.2f}")
    print(json.dumps({"bench": "vllm_kvbm", "args": vars(args), "rows": rows, "ratios": ratios}))


if __name__ == "__main__":
    main()
