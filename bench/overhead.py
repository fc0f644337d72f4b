"""Round-trip overhead of Strata versus the bare Triton binary, for a tiny Python-backend model.

Both servers run the same generated model from the same repository: the bare binary is the `tritonserver` bundled
in the PyTriton wheel, started here directly; Strata is `strata serve`. Each (server, protocol, concurrency) cell is
measured in alternating rounds so that machine noise hits both sides alike; the table shows medians over rounds.

    python bench/overhead.py [--requests 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytriton
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from harness.ports import free_port  # noqa: E402
from harness.servers import start_strata, use_run_secret  # noqa: E402
from harness.stats import percentile  # noqa: E402
from harness.waiting import wait_for  # noqa: E402

MODEL_CONFIG = """name: "identity"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
MODEL_PY = """import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0",
                pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
"""


def make_repository(root: Path) -> Path:
    (root / "repo" / "identity" / "1").mkdir(parents=True)
    (root / "repo" / "identity" / "config.pbtxt").write_text(MODEL_CONFIG)
    (root / "repo" / "identity" / "1" / "model.py").write_text(MODEL_PY)
    return root / "repo"


def start_bare_triton(repo: Path, work: Path) -> tuple[subprocess.Popen, int, int]:
    """The bundled binary with its Python backend, laid out as PyTriton lays it out."""
    dist = Path(pytriton.__file__).parent / "tritonserver"
    backends = work / "backends"
    shutil.copytree(dist / "backends", backends, dirs_exist_ok=True)
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    shutil.copy(dist / "python_backend_stubs" / version / "triton_python_backend_stub", backends / "python")
    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    env = {**os.environ, "LD_LIBRARY_PATH": f"{sysconfig.get_config_var('LIBDIR')}:{libs}"}
    http, grpc = free_port(), free_port()
    process = subprocess.Popen(
        [
            str(dist / "bin" / "tritonserver"),
            "--model-repository",
            str(repo),
            "--backend-directory",
            str(backends),
            "--http-port",
            str(http),
            "--grpc-port",
            str(grpc),
            "--allow-metrics",
            "false",
            "--exit-timeout-secs",
            "2",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
    wait_for(lambda: _ready(client), 60, what="bare Triton ready")
    client.close()
    return process, http, grpc


def _ready(client) -> bool:
    try:
        return client.is_model_ready("identity")
    except Exception:  # not listening yet
        return False


def measure(protocol: str, port: int, concurrency: int, requests: int) -> dict:
    """Latencies (ms) of `requests` calls per client, `concurrency` clients in parallel threads."""
    module = httpclient if protocol == "http" else grpcclient
    data = np.arange(4, dtype=np.float32)
    latencies: list[float] = []
    lock = threading.Lock()

    def run() -> None:
        client = module.InferenceServerClient(f"127.0.0.1:{port}")
        tensor = module.InferInput("INPUT0", [4], "FP32")
        tensor.set_data_from_numpy(data)
        for _ in range(20):  # warm-up
            client.infer("identity", [tensor])
        own = []
        for _ in range(requests):
            start = time.perf_counter()
            client.infer("identity", [tensor])
            own.append((time.perf_counter() - start) * 1e3)
        client.close()
        with lock:
            latencies.extend(own)

    threads = [threading.Thread(target=run) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    return {
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "rps": len(latencies) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1000, help="requests per client per cell")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    use_run_secret()
    cells = [(p, c) for p in ("http", "grpc") for c in (1, 16)]
    results: dict[tuple[str, str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        repo = make_repository(tmp)
        for round_index in range(args.rounds):
            bare, http, grpc = start_bare_triton(repo, tmp / f"bare{round_index}")
            for protocol, concurrency in cells:
                port = http if protocol == "http" else grpc
                results.setdefault(("bare", protocol, concurrency), []).append(
                    measure(
                        protocol,
                        port,
                        concurrency,
                        args.requests // concurrency * (1 if concurrency == 1 else 4),
                    )
                )
            bare.terminate()
            bare.wait(30)
            strata = start_strata(repo, tmp / f"strata{round_index}")
            for protocol, concurrency in cells:
                port = strata.http_port if protocol == "http" else strata.grpc_port
                results.setdefault(("strata", protocol, concurrency), []).append(
                    measure(
                        protocol,
                        port,
                        concurrency,
                        args.requests // concurrency * (1 if concurrency == 1 else 4),
                    )
                )
            strata.stop()
    report(results, cells, args)


def report(results: dict, cells: list, args: argparse.Namespace) -> None:
    def median(server: str, protocol: str, concurrency: int, key: str) -> float:
        return statistics.median(r[key] for r in results[(server, protocol, concurrency)])

    print(f"\nidentity FP32[4] Python-backend model; {args.rounds} rounds, medians; ratio = strata / bare")
    print(
        f"{'protocol':8} {'conc':>4} | {'bare p50':>9} {'p99':>7} {'req/s':>7} | {'strata p50':>10} {'p99':>7}"
        f" {'req/s':>7} | {'p50 ratio':>9}"
    )
    summary = {}
    for protocol, concurrency in cells:
        row = {
            s: {k: median(s, protocol, concurrency, k) for k in ("p50_ms", "p99_ms", "rps")}
            for s in ("bare", "strata")
        }
        ratio = row["strata"]["p50_ms"] / row["bare"]["p50_ms"]
        summary[f"{protocol}_c{concurrency}"] = {
            **{f"{s}_{k}": round(v, 4) for s in row for k, v in row[s].items()},
            "p50_ratio": round(ratio, 3),
        }
        print(
            f"{protocol:8} {concurrency:>4} | {row['bare']['p50_ms']:>9.3f} {row['bare']['p99_ms']:>7.3f}"
            f" {row['bare']['rps']:>7.0f} | {row['strata']['p50_ms']:>10.3f} {row['strata']['p99_ms']:>7.3f}"
            f" {row['strata']['rps']:>7.0f} | {ratio:>9.2f}"
        )
    print(
        json.dumps({"bench": "overhead", "rounds": args.rounds, "requests": args.requests, "cells": summary})
    )


if __name__ == "__main__":
    main()
