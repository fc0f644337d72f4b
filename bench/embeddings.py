"""/v1/embeddings against the same ensemble called over Triton's gRPC, on one `strata serve`.

The server holds copies of the example MiniLM models (`make models`); minilm_embed declares itself an embedding
model. Each round runs both sides one after the other for --seconds each, --concurrency client threads each
sending --texts texts a request: (a) the official openai client's embeddings.create (base64, its default) on the
OpenAI port, (b) tritonclient's gRPC infer of minilm_embed (TEXT in, EMBEDDING out). Texts/s, medians over rounds;
goal: (a) >= 0.9x (b).

    python bench/embeddings.py [--rounds 3] [--seconds 8] [--concurrency 4] [--texts 8]
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
from pathlib import Path

import numpy as np
import openai
import tritonclient.grpc as grpcclient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from bench.machine import cores, cpu_name  # noqa: E402
from harness.servers import StrataProcess, copy_models, start_strata, use_run_secret  # noqa: E402

MINILM = ("minilm_tokenizer", "minilm_encoder", "minilm_pooling", "minilm_embed")
SENTENCES = [
    "Embeddings map text to vectors.",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Triton's dynamic batcher joins requests whose tensors have the same shape into one model call.",
    "Short one.",
    "A sentence embedding is the mean of the encoder's token states, scaled to unit length.",
    "Ensembles run their steps in Triton's core.",
    "Latency at concurrency one shows the fixed cost of every hop: the network, the scheduler and the backend.",
    "Throughput under load shows whether batching pays for it.",
]
GOAL = 0.9


def texts_per_s(
    make_call: Callable[[], Callable[[], object]], concurrency: int, seconds: float, texts: int
) -> float:
    """Texts/s of `concurrency` threads, each calling its own `make_call()` for `seconds` (after one warm call)."""
    done = [0] * concurrency
    stop = threading.Event()

    def loop(index: int) -> None:
        call = make_call()
        call()
        while not stop.is_set():
            call()
            done[index] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # every thread past its warm call
    start, counted = time.perf_counter(), sum(done)
    stop.wait(seconds)
    elapsed, total = time.perf_counter() - start, sum(done) - counted
    stop.set()
    for thread in threads:
        thread.join()
    return total * texts / elapsed


def openai_call(server: StrataProcess, batch: list[str]) -> Callable[[], object]:
    api = openai.OpenAI(base_url=f"{server.openai_url}/v1", api_key="unused", max_retries=0)
    return lambda: api.embeddings.create(model="minilm_embed", input=batch)


def grpc_call(server: StrataProcess, batch: list[str]) -> Callable[[], object]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("TEXT", [len(batch), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[t.encode()] for t in batch], dtype=np.object_))
    output = grpcclient.InferRequestedOutput("EMBEDDING")
    return lambda: client.infer("minilm_embed", [tensor], outputs=[output]).as_numpy("EMBEDDING")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--texts", type=int, default=8, help="texts a request")
    args = parser.parse_args()
    use_run_secret()
    batch = [SENTENCES[i % len(SENTENCES)] for i in range(args.texts)]
    rounds: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        server = start_strata(copy_models(tmp / "repo", *MINILM), tmp)
        try:
            sides = {"openai": lambda: openai_call(server, batch), "grpc": lambda: grpc_call(server, batch)}
            for index in range(args.rounds):  # the side that runs first alternates, so that drift hits both
                order = ["openai", "grpc"] if index % 2 == 0 else ["grpc", "openai"]
                got = {
                    name: texts_per_s(sides[name], args.concurrency, args.seconds, args.texts)
                    for name in order
                }
                rounds.append((got["openai"], got["grpc"]))
        finally:
            server.stop()
    served = statistics.median(r[0] for r in rounds)
    direct = statistics.median(r[1] for r in rounds)
    ratio = served / direct
    cpu = f"{cpu_name()}, {cores()} cores"
    print(f"\n{cpu}; {args.rounds} rounds of {args.seconds:g} s a side, medians; {args.concurrency} clients, "
          f"{args.texts} texts a request")  # fmt: skip
    print(f"{'path':34} {'texts/s':>9}   rounds")
    print(f"{'/v1/embeddings (openai, base64)':34} {served:>9.1f}   {[round(r[0], 1) for r in rounds]}")
    print(f"{'minilm_embed over gRPC':34} {direct:>9.1f}   {[round(r[1], 1) for r in rounds]}")
    print(f"ratio {ratio:.3f} (goal >= {GOAL}x): {'met' if ratio >= GOAL else 'NOT met'}")
    summary = {"bench": "embeddings", "cpu": cpu, "rounds": args.rounds, "seconds": args.seconds}
    summary |= {"concurrency": args.concurrency, "texts": args.texts, "openai_texts_s": round(served, 1)}
    summary |= {
        "grpc_texts_s": round(direct, 1),
        "ratio": round(ratio, 3),
        "goal": GOAL,
        "met": ratio >= GOAL,
    }
    summary |= {"per_round": [[round(a, 1), round(b, 1)] for a, b in rounds]}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
