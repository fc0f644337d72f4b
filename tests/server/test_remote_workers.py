"""`strata serve --accept-remote-workers` + `strata worker` processes (real SmolLM2 engines, real Redis)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from harness.ports import free_port
from harness.servers import ROOT, copy_models, run_cli, start_strata
from harness.waiting import wait_for


def test_cluster_links_refuse_to_start_without_a_secret_and_say_how_to_make_one(
    tmp_path: Path, redis_url
) -> None:
    repository = copy_models(tmp_path / "repo", "smollm2")
    no_secret = {key: value for key, value in os.environ.items() if key != "STRATA_CLUSTER_SECRET"}
    worker = run_cli(
        "worker",
        "--model-repository",
        str(repository),
        "--model",
        "smollm2",
        "--redis-url",
        redis_url,
        "--no-kvbm",
        env=no_secret,
    )
    assert (
        worker.returncode == 2
        and "strata worker" in worker.stderr
        and "secrets.token_hex(32)" in worker.stderr
    )
    server = run_cli(
        "serve",
        "--model-repository",
        str(repository),
        "--accept-remote-workers",
        "--redis-url",
        redis_url,
        "--no-kvbm",
        env=no_secret,
    )
    assert server.returncode == 2 and "--accept-remote-workers needs a cluster secret" in server.stderr
    short = tmp_path / "short.secret"
    short.write_text("tiny\n")
    g4 = run_cli(
        "serve",
        "--model-repository",
        str(repository),
        "--redis-url",
        redis_url,
        "--cluster-secret-file",
        str(short),
        env=no_secret,
    )
    assert g4.returncode == 2 and "at least 16 bytes" in g4.stderr


def test_worker_names_the_missing_redis_url_and_the_unknown_model(tmp_path: Path) -> None:
    repository = copy_models(tmp_path / "repo", "smollm2")
    missing = run_cli("worker", "--model-repository", str(repository), "--model", "smollm2")
    assert missing.returncode == 2 and "--redis-url" in missing.stderr
    unknown = run_cli(
        "worker",
        "--model-repository",
        str(repository),
        "--model",
        "nope",
        "--redis-url",
        "redis://127.0.0.1:1/0",
    )
    assert unknown.returncode == 2
    assert "--model nope: no such model in" in unknown.stderr and "found: smollm2" in unknown.stderr


def test_serve_accept_remote_workers_needs_redis(tmp_path: Path) -> None:
    result = run_cli("serve", "--model-repository", str(tmp_path), "--accept-remote-workers")
    assert result.returncode == 2 and "--accept-remote-workers: needs --redis-url" in result.stderr


def test_serve_workers_0_needs_remote_workers(tmp_path: Path) -> None:
    result = run_cli("serve", "--model-repository", str(tmp_path), "--workers", "0")
    assert result.returncode == 2 and "--workers 0: serves LLMs by remote workers only" in result.stderr


@pytest.fixture
def short_tmp(tmp_path_factory) -> Path:
    """A short folder name: Triton's unix socket paths under it must stay under the AF_UNIX limit."""
    return tmp_path_factory.mktemp("remote")


@pytest.fixture
def workers(short_tmp: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Factory: start `strata worker` (logs in tmp_path); all are killed at teardown."""
    started: list[subprocess.Popen] = []

    def start(repository: Path, redis_url: str, worker_id: str, *extra: str) -> subprocess.Popen:
        log_path = short_tmp / f"{worker_id}-{len(started)}.log"
        log = open(log_path, "w")
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server",
                "worker",
                "--model-repository",
                str(repository),
                "--model",
                "smollm2",
                "--redis-url",
                redis_url,
                "--worker-id",
                worker_id,
                "--host",
                "127.0.0.1",
                "--no-kvbm",
                "--lease-secs",
                "2",
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        process.log_path = log_path  # type: ignore[attr-defined]
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.wait(10)


def worker_metrics(server) -> str:
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{server.openai_port}/metrics", timeout=10).read().decode()
    )
    return "\n".join(line for line in text.splitlines() if line.startswith("strata_worker_"))


def complete(client: openai.OpenAI, prompt: str) -> int:
    answer = client.completions.create(model="smollm2", prompt=prompt, max_tokens=3, temperature=0)
    return answer.usage.completion_tokens


def test_remote_worker_joins_serves_is_routed_around_and_rejoins(short_tmp, redis_url, workers) -> None:
    repository = copy_models(short_tmp / "repo", "smollm2")
    server = start_strata(
        repository,
        short_tmp,
        "--workers",
        "1",
        "--no-kvbm",
        "--redis-url",
        redis_url,
        "--accept-remote-workers",
        "--routing-strategy",
        "round-robin",
    )
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="unused", timeout=120, max_retries=0
    )
    try:
        remote = workers(repository, redis_url, "remote-a")
        wait_for(lambda: "remote worker remote-a joined" in server.log(), 90, what="remote-a joined")
        metrics = worker_metrics(server)
        assert re.search(r'strata_worker_info\{[^}]*device="cpu"[^}]*worker="remote-a"\} 1.0', metrics), (
            metrics
        )
        prefill = re.search(r'strata_worker_prefill_tokens_per_second\{worker="remote-a"\} (\S+)', metrics)
        assert prefill and float(prefill.group(1)) > 0
        assert "calibrated in" in remote.log_path.read_text()
        assert [complete(client, f"Tell me about {topic}.") for topic in ("tea", "rain")] == [3, 3]

        os.kill(remote.pid, signal.SIGKILL)
        wait_for(lambda: 'worker="remote-a"' not in worker_metrics(server), 15, what="remote-a dropped")
        assert complete(client, "Still there?") == 3  # the local worker carries on

        workers(repository, redis_url, "remote-a")  # restarted under the same id
        wait_for(
            lambda: server.log().count("remote worker remote-a joined") == 2, 90, what="remote-a rejoined"
        )
        local_pid = int(re.search(r"worker smollm2-w0 up: pid (\d+)", server.log()).group(1))
        os.kill(local_pid, signal.SIGKILL)
        wait_for(lambda: 'worker="smollm2-w0"' not in worker_metrics(server), 15, what="local worker dropped")
        assert complete(client, "Only the remote worker can answer this.") == 3
    finally:
        client.close()
        server.stop()


def test_model_served_by_remote_workers_only(short_tmp, redis_url, workers) -> None:
    """`--workers 0`: no engine in the server; 503 until a `strata worker` joins, then it serves (tokenizing
    and chat templates included, both done by the worker)."""
    repository = copy_models(short_tmp / "repo", "smollm2")
    server = start_strata(
        repository,
        short_tmp,
        "--workers",
        "0",
        "--no-kvbm",
        "--redis-url",
        redis_url,
        "--accept-remote-workers",
    )
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="unused", timeout=120, max_retries=0
    )
    try:
        assert [model.id for model in client.models.list()] == ["smollm2"]
        with pytest.raises(openai.APIStatusError) as refused:
            complete(client, "Is anyone there?")
        assert refused.value.status_code == 503 and "no worker serves smollm2" in str(refused.value)
        assert "worker smollm2-w0 up" not in server.log()  # no local engine was started

        status_port = free_port()
        workers(repository, redis_url, "only-a", "--metrics-port", str(status_port))
        wait_for(lambda: "remote worker only-a joined" in server.log(), 90, what="only-a joined")
        assert complete(client, "Tell me about tea.") == 3
        status = f"http://127.0.0.1:{status_port}"  # the worker's own probes and series (--metrics-port)
        assert urllib.request.urlopen(f"{status}/v2/health/ready", timeout=10).status == 200
        worker_series = urllib.request.urlopen(f"{status}/metrics", timeout=10).read().decode()
        assert 'strata_num_preemptions_total{model="smollm2"}' in worker_series
        chat = client.chat.completions.create(
            model="smollm2", max_tokens=3, temperature=0, messages=[{"role": "user", "content": "Hi!"}]
        )
        assert chat.usage.completion_tokens == 3 and chat.choices[0].message.content
    finally:
        client.close()
        server.stop()


def test_a_remote_prefill_worker_joins_a_disaggregated_model_and_its_death_falls_back_to_local(
    short_tmp, redis_url, workers
) -> None:
    repository = copy_models(short_tmp / "repo", "smollm2")
    server = start_strata(
        repository, short_tmp, "--prefill-workers", "0", "--decode-workers", "1", "--no-kvbm", "--redis-url",
        redis_url, "--accept-remote-workers", "--max-local-prefill-length", "32",
    )  # fmt: skip
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="unused", timeout=120, max_retries=0
    )
    long_prompt = "Tell me everything about the history of tea, its trade routes and its ceremonies. " * 3

    def prefills() -> str:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.openai_port}/metrics", timeout=10).read()
        return "\n".join(line for line in text.decode().splitlines() if line.startswith("strata_disagg_"))

    try:
        prefill = workers(repository, redis_url, "remote-p", "--role", "prefill")
        wait_for(lambda: "remote worker remote-p joined" in server.log(), 90, what="remote-p joined")
        assert complete(client, long_prompt) == 3
        metrics = prefills()
        assert (
            'strata_disagg_prefills_total{model="smollm2",reason="long_prompt",where="remote"} 1.0' in metrics
        )
        assert 'strata_disagg_kv_transfer_bytes_total{model="smollm2",transport="shm"}' in metrics  # one host
        os.kill(prefill.pid, signal.SIGKILL)
        wait_for(lambda: 'worker="remote-p"' not in worker_metrics(server), 15, what="remote-p dropped")
        assert complete(client, "Again: " + long_prompt) == 3
        assert 'reason="no_prefill_worker",where="local"} 1.0' in prefills()
    finally:
        client.close()
        server.stop()
