"""`strata worker` for a model with backend vllm: the worker re-executes itself under --vllm-python and serves a
`strata serve --workers 0 --accept-remote-workers` server that has no vLLM venv at all (real vLLM, real Redis).

What it checks: the worker joins and answers (completions and chat, tokenized by vLLM's tokenizer in the worker);
with KVBM tiers on, a server that attaches later learns the worker's blocks from its announcement (G1 from the
relay's map, G2 from StrataKVConnector), before any request reaches it; SIGTERM drains and exits 0, deregistered.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from harness.servers import ROOT, start_strata
from harness.waiting import wait_for
from kvbm.host_pool import remove_segments
from server.engine.config import DEFAULT_MODEL
from server.engine.loader import prepare_model
from tests.server.test_workers import metric_lines
from tests.vllm.test_vllm_workers import TRITON_CONFIG

pytestmark = pytest.mark.slow

PROMPT = "Document: " + "Serving systems keep the KV cache of shared prompts warm. " * 30  # ~330 tokens


def write_vllm_model(repository: Path) -> None:
    (repository / "smol_vllm" / "1").mkdir(parents=True)
    (repository / "smol_vllm" / "config.pbtxt").write_text(TRITON_CONFIG.replace("count: 2", "count: 1"))
    model_json = {
        "model": str(prepare_model(DEFAULT_MODEL).folder), "disable_log_requests": True, "enforce_eager": True,
        "kv_cache_memory_bytes": 128 << 20, "max_model_len": 2048, "dtype": "float32", "block_size": 64,
    }  # fmt: skip
    (repository / "smol_vllm" / "1" / "model.json").write_text(json.dumps(model_json))


def serving(server) -> bool:
    """/health is 200 once a worker of every model is routed to (503 while none is)."""
    return httpx.get(f"http://127.0.0.1:{server.openai_port}/health", timeout=10).status_code == 200


def index_blocks(server) -> float:
    return sum(metric_lines(server, "kvbm_index_blocks").values())


def test_a_vllm_worker_on_another_host_serves_announces_its_blocks_and_drains(
    tmp_path_factory, redis_url, vllm_python
) -> None:
    tmp = tmp_path_factory.mktemp("vremote")
    repository = tmp / "repo"
    write_vllm_model(repository)
    cache_id = f"test-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("STRATA_VLLM_PYTHON", None)  # the server has no vLLM venv; only the worker's flag names one
    log_path = tmp / "worker.log"
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            [
                sys.executable, "-m", "server", "worker", "--model-repository", str(repository),
                "--model", "smol_vllm", "--redis-url", redis_url, "--worker-id", "vremote", "--host", "127.0.0.1",
                "--lease-secs", "2", "--vllm-python", vllm_python, "--kvbm-host-cache-gb", "0.25",
                "--kvbm-cache-id", cache_id,
            ],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
        )  # fmt: skip
    servers = []

    def serve():
        server = start_strata(
            repository, tmp / f"server{len(servers)}", "--workers", "0", "--accept-remote-workers",
            "--redis-url", redis_url, "--no-kvbm",
        )  # fmt: skip
        servers.append(server)
        return server

    try:
        first = serve()
        wait_for(lambda: first.log().count("remote worker vremote joined") == 1, 400, what="vremote joined")
        wait_for(
            lambda: serving(first), 30, what="vremote routed to"
        )  # logged joined, then added to the router
        assert "backend vllm: continuing under" in log_path.read_text()
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{first.openai_port}/v1", api_key="-", timeout=120, max_retries=0
        )
        answer = client.completions.create(model="smol_vllm", prompt=PROMPT, max_tokens=4, temperature=0)
        assert answer.usage.completion_tokens == 4
        chat = client.chat.completions.create(
            model="smol_vllm", max_tokens=3, temperature=0, messages=[{"role": "user", "content": "Hi!"}]
        )
        assert chat.usage.completion_tokens == 3 and chat.choices[0].message.content
        wait_for(lambda: index_blocks(first) >= 5, 10, what="the first server's index holds the prompt")
        client.close()
        first.stop()

        second = serve()  # nothing has been asked of it: what its index holds came from the announcement
        wait_for(lambda: second.log().count("remote worker vremote joined") == 1, 60, what="vremote rejoined")
        wait_for(lambda: serving(second), 30, what="vremote routed to")
        wait_for(lambda: index_blocks(second) >= 5, 10, what="the announced blocks")
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{second.openai_port}/v1", api_key="-", timeout=120, max_retries=0
        )
        again = client.completions.create(model="smol_vllm", prompt=PROMPT, max_tokens=4, temperature=0)
        assert again.choices[0].text == answer.choices[0].text
        client.close()

        worker.send_signal(signal.SIGTERM)  # the same process: exec kept its pid
        assert worker.wait(60) == 0
        assert "worker vremote stopped" in log_path.read_text()
        wait_for(
            lambda: not any("vremote" in labels for labels in metric_lines(second, "strata_worker_info")),
            15,
            what="vremote gone from the server",
        )
    finally:
        worker.kill()
        for server in servers:
            server.stop()
        remove_segments(cache_id)
