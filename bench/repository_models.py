"""Strata's cost on repository models (ONNX and an ensemble) against the same work done in this process.

One `strata serve` holds a small add/sub ONNX model built here and copies of the example MiniLM models
(`make models` generates them), each ONNX model with `--threads` onnxruntime threads; the in-process baselines are
onnxruntime sessions on the same files with the same threads. Every round measures each case on both sides, one
after the other, so that machine noise hits both alike; the table shows medians over rounds.

    (a) add_sub_onnx, INT32 [16] + and -, p50 at concurrency 1 over gRPC: the ms Strata adds (goal <= 1 ms)
    (b) minilm_encoder, one text of --tokens tokens, p50 at concurrency 1 over gRPC (goal <= 1.15x in-process)
    (c) minilm_encoder at concurrency 16 through the dynamic batcher, inferences/s, against onnxruntime run at the
        batch sizes Triton formed (its model statistics) (goal >= 0.85x)
    (d) minilm_embed (tokenizer -> encoder -> pooling), --texts texts a request, texts/s at concurrency 1, against
        the same three steps in a loop in this process (goal >= 0.8x)

    python bench/repository_models.py [--rounds 3] [--threads N] [--tokens 128] [--texts 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import tritonclient.grpc as grpcclient
from onnx import TensorProto, helper
from tokenizers import Tokenizer
from tritonclient.utils import np_to_triton_dtype

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from bench.machine import cores, cpu_name  # noqa: E402
from harness.servers import (  # noqa: E402
    EXAMPLE_REPOSITORY,
    StrataProcess,
    copy_models,
    start_strata,
    use_run_secret,
)
from harness.stats import percentile  # noqa: E402

MINILM = ("minilm_tokenizer", "minilm_encoder", "minilm_pooling", "minilm_embed")
ENCODER_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
ADD_SUB_CONFIG = """name: "add_sub_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
"""
THREADS_PARAMETER = '\nparameters { key: "intra_op_thread_count" value: { string_value: "%d" } }\n'
SENTENCES = [
    "Embeddings map text to vectors.",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Triton's dynamic batcher joins requests whose tensors have the same shape into one model call.",
    "Short one.",
    "A sentence embedding is the mean of the encoder's token states, scaled to unit length, so that the dot "
    "product of two embeddings is their cosine similarity.",
    "Ensembles run their steps in Triton's core.",
    "Latency at concurrency one shows the fixed cost of every hop: the network, the scheduler and the backend.",
    "Throughput under load shows whether batching pays for it.",
]


@dataclass(frozen=True, slots=True)
class Case:
    """A measured case: both sides in `unit`, and the figure (`score` of Strata's and the baseline's values)
    whose goal the row checks."""

    name: str
    unit: str
    score: Callable[[float, float], float]
    goal: str
    met: Callable[[float], bool]


CASES = (
    Case("add_sub_onnx p50 c1", "ms", lambda s, b: s - b, "<= 1 ms added", lambda x: x <= 1.0),
    Case("minilm_encoder p50 c1", "ms", lambda s, b: s / b, "<= 1.15x", lambda x: x <= 1.15),
    Case("minilm_encoder c16", "inf/s", lambda s, b: s / b, ">= 0.85x", lambda x: x >= 0.85),
    Case("minilm_embed c1", "texts/s", lambda s, b: s / b, ">= 0.8x", lambda x: x >= 0.8),
)


@dataclass(slots=True)
class Baselines:
    """The in-process side: onnxruntime sessions on the served files with the served threads, and the
    tokenizer the ensemble's first step loads."""

    add_sub: ort.InferenceSession
    encoder: ort.InferenceSession
    tokenizer: Tokenizer


def add_sub_model() -> onnx.ModelProto:
    """INT32 INPUT0, INPUT1 [batch, 16] -> OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""

    def tensor(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", 16])

    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "add_sub",
        [tensor("INPUT0"), tensor("INPUT1")],
        [tensor("OUTPUT0"), tensor("OUTPUT1")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def make_repository(root: Path, threads: int) -> Path:
    """add_sub_onnx and copies of the MiniLM models, every ONNX model with `threads` intra-op threads."""
    encoder_file = EXAMPLE_REPOSITORY / "minilm_encoder" / "1" / "model.onnx"
    if not encoder_file.exists():
        sys.exit(f"{encoder_file} is missing: run `make models` first")
    repository = copy_models(root / "repo", *MINILM)
    (repository / "add_sub_onnx" / "1").mkdir(parents=True)
    (repository / "add_sub_onnx" / "config.pbtxt").write_text(ADD_SUB_CONFIG)
    onnx.save(add_sub_model(), str(repository / "add_sub_onnx" / "1" / "model.onnx"))
    for model in ("add_sub_onnx", "minilm_encoder"):
        config = repository / model / "config.pbtxt"
        config.write_text(config.read_text() + THREADS_PARAMETER % threads)
    return repository


def load_baselines(repository: Path, threads: int) -> Baselines:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads

    def session(model: str) -> ort.InferenceSession:
        path = repository / model / "1" / "model.onnx"
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    folder = repository / "minilm_tokenizer" / "1"
    max_seq_length = json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=max_seq_length)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    return Baselines(session("add_sub_onnx"), session("minilm_encoder"), tokenizer)


def encoder_feed(batch: int, tokens: int) -> dict[str, np.ndarray]:
    """[CLS] w... [SEP] of `tokens` word-piece ids (a fixed random draw), no padding, `batch` rows alike."""
    ids = np.random.default_rng(0).integers(1000, 30000, size=tokens, dtype=np.int64)
    ids[0], ids[-1] = 101, 102
    rows = np.tile(ids, (batch, 1))
    return {"input_ids": rows, "attention_mask": np.ones_like(rows), "token_type_ids": np.zeros_like(rows)}


def grpc_inputs(feed: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in feed.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def p50_ms(call: Callable[[], object], requests: int, warmup: int = 10) -> float:
    for _ in range(warmup):
        call()
    latencies = []
    for _ in range(requests):
        start = time.perf_counter()
        call()
        latencies.append((time.perf_counter() - start) * 1e3)
    return percentile(latencies, 50)


def items_per_s(call: Callable[[], object], requests: int, items: int) -> float:
    """`items` per call, `requests` calls one after the other (after one warm-up call)."""
    call()
    start = time.perf_counter()
    for _ in range(requests):
        call()
    return requests * items / (time.perf_counter() - start)


def measure_add_sub(server: StrataProcess, baselines: Baselines, requests: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    feed = {name: rng.integers(-100, 100, size=(1, 16), dtype=np.int32) for name in ("INPUT0", "INPUT1")}
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = grpc_inputs(feed)
    served = p50_ms(lambda: client.infer("add_sub_onnx", inputs).as_numpy("OUTPUT0"), requests)
    client.close()
    return served, p50_ms(lambda: baselines.add_sub.run(None, feed), requests)


def measure_encoder_latency(
    server: StrataProcess, baselines: Baselines, tokens: int, requests: int
) -> tuple[float, float]:
    feed = encoder_feed(1, tokens)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = grpc_inputs(feed)
    served = p50_ms(lambda: client.infer("minilm_encoder", inputs).as_numpy("last_hidden_state"), requests)
    client.close()
    return served, p50_ms(lambda: baselines.encoder.run(None, feed), requests)


def batch_counts(server: StrataProcess) -> dict[int, int]:
    """minilm_encoder's executions so far by batch size (Triton's model statistics)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    stats = client.get_inference_statistics("minilm_encoder", as_json=True)["model_stats"][0]
    client.close()
    return {int(s["batch_size"]): int(s["compute_infer"]["count"]) for s in stats.get("batch_stats", [])}


def served_throughput(server: StrataProcess, tokens: int, concurrency: int, seconds: float) -> float:
    """Inferences/s of `concurrency` clients, each sending one text after another for `seconds`."""
    inputs = grpc_inputs(encoder_feed(1, tokens))
    done = [0] * concurrency
    deadline = time.perf_counter() + seconds

    def client_loop(index: int) -> None:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        while time.perf_counter() < deadline:
            client.infer("minilm_encoder", inputs).as_numpy("last_hidden_state")
            done[index] += 1
        client.close()

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) / (time.perf_counter() - start)


def in_process_throughput(baselines: Baselines, tokens: int, executions: dict[int, int]) -> float:
    """Inferences/s of onnxruntime running `executions` (batch size -> count), each size timed by its median
    of three runs after one warm-up run."""
    busy_s = 0.0
    for batch, count in executions.items():
        feed = encoder_feed(batch, tokens)
        baselines.encoder.run(None, feed)
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            baselines.encoder.run(None, feed)
            runs.append(time.perf_counter() - start)
        busy_s += count * statistics.median(runs)
    return sum(batch * count for batch, count in executions.items()) / busy_s


def measure_encoder_throughput(
    server: StrataProcess, baselines: Baselines, tokens: int, seconds: float
) -> tuple[float, float, dict[int, int]]:
    before = batch_counts(server)
    served = served_throughput(server, tokens, 16, seconds)
    after = batch_counts(server)
    executions = {b: n - before.get(b, 0) for b, n in sorted(after.items()) if n > before.get(b, 0)}
    return served, in_process_throughput(baselines, tokens, executions), executions


def embed_in_process(baselines: Baselines, texts: list[str]) -> np.ndarray:
    """The ensemble's three steps in this process: tokenize, encode, mean-pool and L2-normalise."""
    encodings = baselines.tokenizer.encode_batch(texts)
    feed = {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
    }
    (hidden,) = baselines.encoder.run(["last_hidden_state"], feed)
    weights = feed["attention_mask"][:, :, None].astype(np.float32)
    mean = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
    return mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12)


def measure_ensemble(
    server: StrataProcess, baselines: Baselines, texts: int, requests: int
) -> tuple[float, float]:
    batch = [SENTENCES[i % len(SENTENCES)] for i in range(texts)]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("TEXT", [texts, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[t.encode()] for t in batch], dtype=np.object_))
    served = items_per_s(
        lambda: client.infer("minilm_embed", [tensor]).as_numpy("EMBEDDING"), requests, texts
    )
    client.close()
    return served, items_per_s(lambda: embed_in_process(baselines, batch), requests, texts)


def run_round(server: StrataProcess, baselines: Baselines, args: argparse.Namespace) -> dict:
    """One measurement of every case: name -> (Strata's value, the baseline's value)."""
    add_sub = measure_add_sub(server, baselines, args.requests)
    encoder_c1 = measure_encoder_latency(server, baselines, args.tokens, args.requests // 5)
    *encoder_c16, batch_sizes = measure_encoder_throughput(server, baselines, args.tokens, args.seconds)
    ensemble = measure_ensemble(server, baselines, args.texts, args.requests // 10)
    values = dict(
        zip((case.name for case in CASES), (add_sub, encoder_c1, encoder_c16, ensemble), strict=True)
    )
    return values | {"batch_sizes": batch_sizes}


def report(rounds: list[dict], args: argparse.Namespace) -> None:
    cpu = f"{cpu_name()}, {cores()} cores"
    print(
        f"\n{cpu}; onnxruntime {ort.__version__}, {args.threads} intra-op threads both sides; {args.rounds}"
        f" rounds, medians; encoder: 1 text of {args.tokens} tokens a request; ensemble: {args.texts} texts"
    )
    print(f"{'case':24} {'unit':>8} | {'strata':>9} {'in-proc':>9} | {'result':>8} {'goal':>14} {'met':>4}")
    cells = {}
    for case in CASES:
        served = statistics.median(r[case.name][0] for r in rounds)
        baseline = statistics.median(r[case.name][1] for r in rounds)
        score = case.score(served, baseline)
        met = case.met(score)
        cells[case.name] = {
            "strata": round(served, 3),
            "in_process": round(baseline, 3),
            "result": round(score, 3),
        }
        cells[case.name] |= {"goal": case.goal, "met": met}
        print(
            f"{case.name:24} {case.unit:>8} | {served:>9.3f} {baseline:>9.3f} | {score:>8.3f} {case.goal:>14}"
            f" {'yes' if met else 'NO':>4}"
        )
    batch_sizes = [r["batch_sizes"] for r in rounds]
    print(f"batch sizes Triton formed at c16 (size: executions), by round: {batch_sizes}")
    summary = {"bench": "repository_models", "cpu": cpu, "threads": args.threads, "rounds": args.rounds}
    summary |= {"tokens": args.tokens, "texts": args.texts, "cells": cells, "batch_sizes": batch_sizes}
    print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=cores(), help="onnxruntime threads")
    parser.add_argument(
        "--requests", type=int, default=500, help="add_sub requests a side a round (encoder: /5)"
    )
    parser.add_argument("--seconds", type=float, default=8, help="the concurrency-16 run's length a round")
    parser.add_argument("--tokens", type=int, default=128, help="tokens of the encoder's text")
    parser.add_argument("--texts", type=int, default=8, help="texts of an ensemble request")
    args = parser.parse_args()
    use_run_secret()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        repository = make_repository(tmp, args.threads)
        baselines = load_baselines(repository, args.threads)
        server = start_strata(repository, tmp)
        try:
            rounds = [run_round(server, baselines, args) for _ in range(args.rounds)]
        finally:
            server.stop()
    report(rounds, args)


if __name__ == "__main__":
    main()
