"""Servers under test or benchmark: `strata serve` as a real subprocess on free ports, the private model
repositories it serves, and vLLM's OpenAI server from its own venv."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from harness.ports import free_port
from harness.waiting import wait_for

PR_SET_PDEATHSIG = 1  # prctl(2)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_REPOSITORY = ROOT / "model_repository"
MODEL_CACHE = (
    ROOT / ".strata-cache" / "models"
)  # the benchmarks' GGUF conversion cache (model.json cache_dir)


def use_run_secret() -> str:
    """A cluster secret of this run's own (32 random bytes, hex) as STRATA_CLUSTER_SECRET, for this process and
    every strata process it starts: a benchmark never runs with the tests' public secret."""
    secret = secrets.token_hex(32)
    os.environ["STRATA_CLUSTER_SECRET"] = secret
    return secret


def copy_models(destination: Path, *names: str) -> Path:
    """A private repository holding copies of example models (the caller may edit it freely).

    An LLM's copy runs in float32: the example says `dtype: auto`, which is bf16 on CPUs with bf16 dot products
    and fp32 elsewhere, and expected outputs must not depend on which CPU runs them."""
    destination.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copytree(
            EXAMPLE_REPOSITORY / name, destination / name, ignore=shutil.ignore_patterns("__pycache__")
        )
        for model_json in (destination / name).glob("*/model.json"):
            config = json.loads(model_json.read_text())
            if config.get("dtype") == "auto":
                model_json.write_text(json.dumps({**config, "dtype": "float32"}, indent=2) + "\n")
    return destination


def smollm2_repository(root: Path, **model_json: Any) -> Path:
    """`root`/repository holding only smollm2 (copy_models), its model.json updated with `model_json`; a pool
    given in blocks (`num_kv_blocks`) replaces the example's size in bytes."""
    repository = copy_models(root / "repository", "smollm2")
    path = repository / "smollm2" / "1" / "model.json"
    config = json.loads(path.read_text()) | model_json
    if "num_kv_blocks" in model_json:
        config.pop("kv_cache_bytes", None)
    path.write_text(json.dumps(config, indent=2))
    return repository


@dataclass
class StrataProcess:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path
    runtime_dir: Path
    openai_port: int

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def is_ready(self) -> bool:
        return "strata ready" in self.log()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m server <args>` to its end (a flag check, not a server): exit code and output."""
    return subprocess.run(
        [sys.executable, "-m", "server", *args], capture_output=True, text=True, cwd=ROOT, timeout=60, env=env
    )


def short_runtime_dir(tmp_path: Path) -> Path:
    """/tmp/strata-rt-<digest of tmp_path>: Triton's workspace goes there, whose Unix socket paths must stay under
    108 bytes (a pytest-xdist worker's tmp_path is longer than a plain run's). The same `tmp_path` gives the same
    folder, so a server restarted on it finds what the last one left."""
    digest = hashlib.blake2b(str(tmp_path.resolve()).encode(), digest_size=6).hexdigest()
    return Path(tempfile.gettempdir()) / f"strata-rt-{digest}"


def start_strata(
    repository: Path,
    tmp_path: Path,
    *args: str,
    wait_ready: bool = True,
    ports: tuple[int, int, int] | None = None,
    ready_timeout_s: float = 120,
    env: dict[str, str] | None = None,
) -> StrataProcess:
    """`strata serve` on free ports (HTTP, gRPC, metrics, OpenAI) with `args`, its log under `tmp_path` and its
    runtime dir named after it (`short_runtime_dir`), in a session of its own; waits for "strata ready" unless
    `wait_ready` is false. A port taken between picking and binding it (another process's) costs one more start
    on other ports, unless `ports` were given. `env`: variables added to this process's for the server."""
    for attempt in range(3):
        server = _start_strata(repository, tmp_path, args, ports, env or {})
        if not wait_ready:
            return server
        try:
            wait_for(
                lambda s=server: s.is_ready() or s.process.poll() is not None,
                ready_timeout_s,
                what="strata ready",
            )
        except TimeoutError:
            server.stop(signal.SIGKILL)
            raise
        if server.process.poll() is None:
            return server
        log = server.log()
        if ports is not None or "Address already in use" not in log or attempt == 2:
            raise RuntimeError(f"strata exited with {server.process.returncode}:\n{log[-3000:]}")
    raise AssertionError("unreachable")


def _start_strata(
    repository: Path,
    tmp_path: Path,
    args: Sequence[str],
    ports: tuple[int, int, int] | None,
    extra_env: dict[str, str],
) -> StrataProcess:
    http, grpc, metrics = ports or (free_port(), free_port(), free_port())
    openai_port = free_port()
    tmp_path.mkdir(parents=True, exist_ok=True)
    log_path = tmp_path / f"strata-{http}.log"
    runtime_dir = short_runtime_dir(tmp_path)
    env = {**os.environ, "STRATA_RUNTIME_DIR": str(runtime_dir), "PYTHONUNBUFFERED": "1", **extra_env}
    command = [sys.executable, "-m", "server", "serve", "--model-repository", str(repository)]
    command += ["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    command += ["--http-address", "127.0.0.1", "--exit-timeout-secs", "5", "--openai-port", str(openai_port)]
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            [*command, *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
            preexec_fn=_stop_with_this_process(),
        )
    return StrataProcess(process, http, grpc, metrics, log_path, runtime_dir, openai_port)


def _stop_with_this_process() -> Callable[[], None] | None:
    """For a server started from the main thread: the kernel sends it SIGTERM (a graceful stop) when this process
    dies, so a test process killed mid-file (the OOM killer, a timeout) leaves no server, workers or vLLM engine
    holding memory for the rest of the run. Not from other threads: the signal follows the thread that started
    the child, not the process."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:  # not glibc
        return None
    parent = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return in_child


def triton_generate(server: StrataProcess, prompt: str, max_tokens: int, model: str = "smollm2") -> dict:
    """A greedy request to `model`'s Triton generate endpoint, with `num_cached_tokens` in the answer."""
    body = {
        "text_input": prompt,
        "return_num_cached_tokens": True,
        "parameters": {"temperature": 0, "max_tokens": max_tokens},
    }
    response = httpx.post(f"http://{server.http_url}/v2/models/{model}/generate", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


@dataclass
class Server:
    """An OpenAI-compatible server a benchmark drives: its base URL and the pid of its process tree's root."""

    url: str
    pid: int


@contextmanager
def strata_openai(dtype: str, threads: int, flags: Sequence[str] = ()) -> Iterator[Server]:
    """`strata serve` of SmolLM2 in `dtype` with `threads` torch threads, 2,048 KV blocks and a 2,048-token step
    (vllm_server's peer), and more `flags`; stopped when the block ends."""
    with tempfile.TemporaryDirectory(prefix="strata-peers-") as tmp:
        repository = smollm2_repository(
            Path(tmp), dtype=dtype, num_threads=threads, num_kv_blocks=2048, max_num_batched_tokens=2048
        )
        server = start_strata(repository, Path(tmp) / "run", *flags)
        try:
            yield Server(server.openai_url, server.process.pid)
        finally:
            server.stop()


@contextmanager
def vllm_server(
    vllm_python: str, folder: Path, dtype: str, threads: int, extra_args: Sequence[str] = ()
) -> Iterator[Server]:
    """vLLM's OpenAI server from its own venv (`vllm_python`) serving the HF `folder` as "smollm2" in `dtype`,
    its OpenMP threads bound to the first `threads` cores, prefix caching on; KV space 2 GiB unless `extra_args`
    (more `vllm serve` flags) say otherwise. Stopped, with every process it started, when the block ends."""
    port = free_port()
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
    }  # fmt: skip
    # vLLM starts in another cwd; abspath keeps the venv's symlink (realpath would not)
    command = [
        os.path.abspath(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
        "--served-model-name", "smollm2", "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
        "--max-model-len", "4096", "--enable-prefix-caching", "--disable-log-stats", *extra_args,
    ]  # fmt: skip
    with tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir()
        )
    url = f"http://127.0.0.1:{port}"
    try:
        what = f"vLLM healthy (its log: {log.name})"
        wait_for(lambda: _healthy(url) or process.poll() is not None, 900, interval=1, what=what)
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited with {process.returncode}; its log: {log.name}")
        yield Server(url, process.pid)
    finally:
        stop_tree(process)


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
