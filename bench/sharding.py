"""Sharded engines: tokens/s of one process against tensor- and pipeline-parallel groups, the all-reduce's cost per
decode step against gloo's own all-reduce of the same tensor, and the pipeline's bubble; all in the same run.

    .venv/bin/python bench/sharding.py [--model smollm2|llama-1b] [--configs tp1,tp3,pp2] [--dtype auto]
                                       [--prefill-tokens 512] [--decode-tokens 32] [--reps 3] [--threads N] [--kill]

    smollm2   the example's SmolLM2-135M (9 heads, 3 KV heads: tensor-parallel sizes 1 and 3)
    llama-1b  a Llama of 1.0 B parameters with random weights (hidden 1536, 24 heads, 6 KV heads, 28 layers,
              SmolLM2's vocabulary), written once to a temporary folder: a model whose layers, not its
              per-step overhead, dominate a step (tensor-parallel sizes 1, 2 and 3)

Per configuration (medians over --reps, fresh random prompts each time, so nothing is a cache hit):
  prefill    time to the first token of a --prefill-tokens prompt -> prompt tokens/s
  decode 1   one request's tokens/s after its first (--decode-tokens after a 256-token prompt)
  decode 8   8 requests at once, generated tokens / wall (the pipeline's micro-batches overlap here)
  all-reduce mean seconds per decode step in the driver's all-reduces (waiting for the slowest rank included),
             against `floor`: the same number of gloo processes all-reducing the same [1, hidden] fp32 tensor
             back to back (gloo's own cost, measured in this run; goal: at most 1.3x of it), and `shm`: the
             shared-memory all-reduce the engine uses on the CPU, back to back the same way
  bubble     pipeline only, during decode 8: 1 - (seconds every rank computed) / (ranks x wall seconds)
  lm_head    on the unsharded engine: the whole head's GEMM for 8 rows against one rank's vocabulary slice of it
             plus gloo's transfer of that slice's logits (why the head is vocab-parallel)
  --kill     each sharded config: SIGKILL its last rank while 4 requests decode: seconds until the group saw it,
             until every rank served again, requests lost, answers changed against a rerun
Threads: --threads per rank (default: this host's cores / ranks, at least 1). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import queue
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.engine.api import GenerationRequest, RequestId, SamplingParams  # noqa: E402
from server.engine.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from server.engine.llm_engine import LLMEngine  # noqa: E402
from server.engine.loader import prepare_model  # noqa: E402
from server.engine.parallel.executor import ShardedExecutor  # noqa: E402

VOCAB_LOW, VOCAB_HIGH = 100, 40_000  # plain-text token ids
LLAMA_1B = {
    "model_type": "llama", "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 28,
    "num_attention_heads": 24, "num_key_value_heads": 6, "vocab_size": 49152, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "eos_token_id": 2,
}  # fmt: skip


def random_llama(folder: Path, shape: dict, dtype: torch.dtype) -> Path:
    """A Llama checkpoint of `shape` with random weights (std 0.02) and SmolLM2's tokenizer, in `folder`."""
    from safetensors.torch import save_file

    smollm2 = prepare_model(DEFAULT_MODEL).folder
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, folder / name)
    (folder / "config.json").write_text(json.dumps(shape))
    h, i, d = (
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["hidden_size"] // shape["num_attention_heads"],
    )
    kv = shape["num_key_value_heads"] * d
    generator = torch.Generator().manual_seed(0)

    def weight(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * 0.02).to(dtype)

    tensors = {
        "model.embed_tokens.weight": weight(shape["vocab_size"], h),
        "model.norm.weight": torch.ones(h, dtype=dtype),
    }
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "self_attn.q_proj.weight": weight(h, h), p + "self_attn.k_proj.weight": weight(kv, h),
            p + "self_attn.v_proj.weight": weight(kv, h), p + "self_attn.o_proj.weight": weight(h, h),
            p + "mlp.gate_proj.weight": weight(i, h), p + "mlp.up_proj.weight": weight(i, h),
            p + "mlp.down_proj.weight": weight(h, i), p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        }  # fmt: skip
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


class Bench:
    def __init__(self, engine: LLMEngine, rng: random.Random) -> None:
        self.engine, self.rng, self.count = engine, rng, 0

    def request(self, prompt_tokens: int, max_tokens: int) -> GenerationRequest:
        self.count += 1
        prompt = [self.rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(prompt_tokens)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return GenerationRequest(RequestId(f"bench-{self.count}"), prompt, params)

    def run(self, requests: list[GenerationRequest]) -> tuple[float, list[float], list[float], int]:
        """Submit at once: wall seconds, each request's first and last output times, generated tokens."""
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        started = time.perf_counter()
        for request in requests:
            self.engine.submit(request, outputs.put)
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        generated = finished = 0
        while finished < len(requests):
            output = outputs.get(timeout=1800)
            now = time.perf_counter() - started
            first.setdefault(output.request_id, now)
            last[output.request_id] = now
            generated += len(output.new_token_ids)
            finished += output.finished
        return time.perf_counter() - started, list(first.values()), list(last.values()), generated


def measure(engine: LLMEngine, args: argparse.Namespace, rng: random.Random) -> dict:
    bench = Bench(engine, rng)
    bench.run([bench.request(32, 4)])  # warm-up: kernels, workspaces
    sharded = engine.config.world_size > 1
    executor: ShardedExecutor | None = engine.runner if sharded else None  # type: ignore[assignment]
    prefill, decode1, decode8, reduce_step, bubble = [], [], [], [], []
    for _ in range(args.reps):
        _, first, _, _ = bench.run([bench.request(args.prefill_tokens, 1)])
        prefill.append(args.prefill_tokens / first[0])
        comm = executor.stage.comm if executor is not None else None
        before = (comm.reduce_s, comm.reduce_calls) if comm is not None else (0.0, 0)
        _, first, last, generated = bench.run([bench.request(256, args.decode_tokens)])
        decode1.append((generated - 1) / (last[0] - first[0]))
        if comm is not None and comm.reduce_calls > before[1]:
            per_call = (comm.reduce_s - before[0]) / (comm.reduce_calls - before[1])
            reduce_step.append(per_call * 2 * len(engine.model.layers))
        busy_before = [r.busy_s for r in engine.stats().ranks]
        wall, _, _, generated = bench.run([bench.request(128, args.decode_tokens) for _ in range(8)])
        decode8.append(generated / wall)
        busy = [r.busy_s for r in engine.stats().ranks]
        if executor is not None and executor.plan.pp_size > 1:
            computed = sum(b - a for a, b in zip(busy_before, busy, strict=True))
            bubble.append(1 - computed / (len(busy) * wall))
    return {
        "prefill_tok_s": statistics.median(prefill),
        "decode1_tok_s": statistics.median(decode1),
        "decode8_tok_s": statistics.median(decode8),
        "allreduce_step_ms": statistics.median(reduce_step) * 1e3 if reduce_step else None,
        "bubble": statistics.median(bubble) if bubble else None,
    }


def measure_kill(engine: LLMEngine, rng: random.Random, tokens: int) -> dict:
    """SIGKILL the last rank while 4 requests decode: seconds until the group saw it (`detect_s`) and until every
    rank served again (`recover_s`), requests that ended in an error, and answers that differ from the same
    requests run again afterwards (greedy: 0 when the requeued requests were recomputed exactly)."""
    bench = Bench(engine, rng)
    requests = [bench.request(128, tokens) for _ in range(4)]
    answers: dict[str, list[int]] = {r.request_id: [] for r in requests}
    errors: list[str] = []
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    for request in requests:
        engine.submit(request, outputs.put)
    finished = generated = 0
    killed = recovered = victim = None
    group = engine.runner.group
    while finished < len(requests) or recovered is None:
        try:
            output = outputs.get(timeout=0.005)
        except queue.Empty:
            output = None
        if output is not None:
            answers[output.request_id] += output.new_token_ids
            generated += len(output.new_token_ids)
            finished += output.finished
            errors += [output.error] if output.error else []
        if killed is None and generated >= 8:
            victim = engine.stats().ranks[-1].pid
            os.kill(victim, 9)
            killed = time.monotonic()
        seen = group.last_failure is not None and killed is not None and group.last_failure.at >= killed
        ranks = engine.stats().ranks if seen and recovered is None else []
        if (
            ranks and all(r.up for r in ranks) and victim not in {r.pid for r in ranks}
        ):  # new processes, serving
            recovered = time.monotonic() - killed
    detected = group.last_failure.at - killed
    changed = 0
    for request in requests:
        rerun = GenerationRequest(
            RequestId(f"{request.request_id}-check"), request.prompt_token_ids, request.sampling
        )
        tokens_again: list[int] = []
        check: queue.SimpleQueue = queue.SimpleQueue()
        engine.submit(rerun, check.put)
        while not (out := check.get(timeout=600)).finished:
            tokens_again += out.new_token_ids
        tokens_again += out.new_token_ids
        changed += tokens_again != answers[request.request_id]
    return {"detect_s": detected, "recover_s": recovered, "errors": len(errors), "changed_answers": changed}


def lm_head_costs(engine: LLMEngine, tp: int, rows: int = 8, reps: int = 50) -> dict:
    """The choice between a replicated and a vocab-parallel lm_head, in its parts (ms, one step of `rows` rows, on
    this process's threads): the whole head on one rank, a 1/`tp` slice of it (each rank's share, computed at the
    same time), and the transfer of one slice of fp32 logits between two gloo processes."""
    from server.engine import linear

    model = engine.model
    full = model.lm_head if model.shard is None else None
    if full is None:
        raise ValueError("measure the lm_head on an unsharded engine")
    x = torch.randn(rows, model.shape.hidden_size, dtype=model.dtype)
    vocab = model.shape.vocab_size
    weight = model.embed if model.shape.tie_word_embeddings else None
    sliced = (
        linear.pack(weight[: vocab // tp].clone(), model.packed, model.linear_kernel)
        if weight is not None
        else None
    )

    def timed(w) -> float:
        for _ in range(3):
            linear.linear(x, w, None, model.min_rows)
        started = time.perf_counter()
        for _ in range(reps):
            linear.linear(x, w, None, model.min_rows)
        return (time.perf_counter() - started) / reps * 1e3

    costs = {"rows": rows, "whole_ms": timed(full)}
    if sliced is not None:
        costs["slice_ms"] = timed(sliced)
        costs["transfer_ms"] = p2p_seconds(rows * (vocab // tp)) * 1e3
    return costs


def rank_zero_result(target, world: int, *args) -> float:
    """Run `target(rank, *args, result)` in `world` spawned processes; what rank 0 puts in `result`."""
    context = multiprocessing.get_context("spawn")
    result = context.Queue()
    ranks = [context.Process(target=target, args=(rank, *args, result)) for rank in range(world)]
    for process in ranks:
        process.start()
    try:
        return result.get(timeout=600)
    finally:
        for process in ranks:
            process.join(60)


def _free_port() -> int:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, 1, True).port  # a free port (this store is dropped right away)


def _p2p_rank(rank: int, port: int, numel: int, calls: int, result) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore("p2p", store), rank, 2, timeout)
    tensor = torch.ones(numel)
    started = None
    for call in range(calls + 10):
        if call == 10:
            started = time.perf_counter()
        if rank == 1:
            group.send([tensor], 0, call).wait()
        else:
            group.recv([tensor], 1, call).wait()
    if rank == 0:
        result.put((time.perf_counter() - started) / calls)


def p2p_seconds(numel: int, calls: int = 200) -> float:
    """Seconds to send `numel` fp32 values from one gloo process to another."""
    return rank_zero_result(_p2p_rank, 2, _free_port(), numel, calls)


def _floor_rank(rank: int, world: int, port: int, hidden: int, calls: int, result) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore("floor", store), rank, world, timeout)
    tensor = torch.ones(1, hidden)
    for _ in range(20):
        group.allreduce([tensor]).wait()
    started = time.perf_counter()
    for _ in range(calls):
        group.allreduce([tensor]).wait()
    if rank == 0:
        result.put((time.perf_counter() - started) / calls)


def _shm_floor_rank(rank: int, name: str, hidden: int, calls: int, result) -> None:
    from server.engine.kernels import cpu_kernels
    from server.engine.parallel.comm import ShmAllReduce, segment_path

    torch.set_num_threads(1)
    shm = ShmAllReduce(cpu_kernels(), segment_path(name, 0), rank, timeout_s=60)
    tensor = torch.ones(1, hidden)
    for _ in range(20):
        shm(tensor)
    started = time.perf_counter()
    for _ in range(calls):
        shm(tensor)
    if rank == 0:
        result.put((time.perf_counter() - started) / calls)


def shm_floor(world: int, hidden: int, calls: int = 2000) -> float | None:
    """Seconds per shared-memory all-reduce (the engine's on the CPU) of the same tensor, back to back."""
    from server.engine.kernels import cpu_kernels
    from server.engine.parallel.comm import ShmAllReduce, segment_path

    if cpu_kernels() is None:
        return None
    name = f"strata-bench-{os.getpid()}"
    spin = world <= len(os.sched_getaffinity(0))
    ShmAllReduce.create(cpu_kernels(), segment_path(name, 0), world, 1 << 16, spin=spin)
    try:
        return rank_zero_result(_shm_floor_rank, world, name, hidden, calls)
    finally:
        segment_path(name, 0).unlink(missing_ok=True)


def allreduce_floor(world: int, hidden: int, calls: int = 600) -> float:
    """Seconds per gloo all-reduce of a [1, hidden] fp32 tensor among `world` processes, back to back."""
    return rank_zero_result(_floor_rank, world, world, _free_port(), hidden, calls)


def parse_config(name: str) -> tuple[int, int]:
    """ "tp3" -> (3, 1); "pp2" -> (1, 2); "tp2pp2" -> (2, 2); "tp1" -> (1, 1)."""
    tp = pp = 1
    for part, value in ((p[:2], int(p[2:])) for p in name.replace("pp", " pp").split()):
        tp, pp = (value, pp) if part == "tp" else (tp, value)
    return tp, pp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "llama-1b"), default="smollm2")
    parser.add_argument(
        "--configs", default=None, help="comma-separated, e.g. tp1,tp3,pp2 (default by model)"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="per rank (default: cores / ranks)")
    parser.add_argument(
        "--kill", action="store_true", help="also SIGKILL a rank mid-decode (each sharded config)"
    )
    args = parser.parse_args()
    configs = (args.configs or ("tp1,tp3,pp2" if args.model == "smollm2" else "tp1,tp2,tp3,pp2")).split(",")
    folder = None
    model = DEFAULT_MODEL
    if args.model == "llama-1b":
        folder = Path(tempfile.mkdtemp(prefix="strata-llama-1b-"))
        model = str(random_llama(folder, LLAMA_1B, torch.bfloat16))
    cores = len(os.sched_getaffinity(0))
    rows, floors = [], {}
    try:
        for name in configs:
            tp, pp = parse_config(name)
            config = EngineConfig(
                model=model, dtype=args.dtype, device="cpu", num_kv_blocks=1024, max_model_len=2048,
                max_num_batched_tokens=2048, max_tokens_limit=512, tensor_parallel_size=tp, pipeline_parallel_size=pp,
            )  # fmt: skip
            threads = args.threads or max(1, cores // config.world_size)
            config = msgspec.structs.replace(config, num_threads=threads)
            with LLMEngine(config) as engine:
                row = {"config": name, "ranks": config.world_size, "threads_per_rank": threads,
                       **measure(engine, args, random.Random(0))}  # fmt: skip
                if args.kill and config.world_size > 1:
                    row["kill"] = measure_kill(engine, random.Random(1), args.decode_tokens)
                if config.world_size == 1:
                    largest = max(parse_config(c)[0] for c in configs)
                    row["lm_head"] = lm_head_costs(engine, max(largest, 2))
                hidden, layers = (
                    engine.model.shape.hidden_size,
                    len(engine.model.layers),
                )  # the driver's stage
            if tp > 1:
                if tp not in floors:
                    floors[tp] = (allreduce_floor(tp, hidden), shm_floor(tp, hidden))
                gloo, shm = floors[tp]
                row["floor_step_ms"] = gloo * 2 * layers * 1e3
                row["allreduce_vs_floor"] = row["allreduce_step_ms"] / row["floor_step_ms"]
                if shm is not None:
                    row["shm_floor_step_ms"] = shm * 2 * layers * 1e3
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    base = rows[0]
    print(
        f"\nmodel {args.model}, dtype {args.dtype}, {cores} cores, medians of {args.reps}; x = ratio to {base['config']}"
    )
    header = "config    ranks thr  prefill tok/s      decode1 tok/s      decode8 tok/s      allreduce ms/step (floor)  bubble"
    print(header)
    for row in rows:
        cell = {
            key: f"{row[key]:8.1f} ({row[key] / base[key]:4.2f}x)"
            for key in ("prefill_tok_s", "decode1_tok_s", "decode8_tok_s")
        }
        reduce = ""
        if row.get("allreduce_step_ms") is not None and "floor_step_ms" in row:
            reduce = f"{row['allreduce_step_ms']:7.2f} ({row['floor_step_ms']:.2f}, {row['allreduce_vs_floor']:.2f}x)"
            if "shm_floor_step_ms" in row:
                reduce += f" shm {row['shm_floor_step_ms']:.2f}"
        bubble = f"{row['bubble']:.2f}" if row.get("bubble") is not None else ""
        print(f"{row['config']:<9} {row['ranks']:>5} {row['threads_per_rank']:>3}  {cell['prefill_tok_s']}  "
              f"{cell['decode1_tok_s']}  {cell['decode8_tok_s']}  {reduce:<26} {bubble}")  # fmt: skip
    for row in rows:
        if "lm_head" in row and "slice_ms" in row["lm_head"]:
            head = row["lm_head"]
            print(f"lm_head, {head['rows']} rows: whole on one rank {head['whole_ms']:.2f} ms; vocab-parallel "
                  f"{head['slice_ms']:.2f} ms per rank + {head['transfer_ms']:.2f} ms to bring a slice's logits "
                  "to the driver")  # fmt: skip
        if "kill" in row:
            kill = row["kill"]
            print(f"{row['config']}: rank killed mid-decode: seen in {kill['detect_s']:.3f} s, every rank serving "
                  f"again after {kill['recover_s']:.2f} s, {kill['errors']} requests failed, "
                  f"{kill['changed_answers']} of 4 answers changed")  # fmt: skip
    print(
        json.dumps(
            {"bench": "sharding", "model": args.model, "dtype": args.dtype, "cores": cores, "rows": rows}
        )
    )


if __name__ == "__main__":
    main()
