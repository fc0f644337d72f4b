"""`strata serve --workers 2 --tensor-parallel-size 3`: two workers of three rank processes each. A rank killed with
SIGKILL under streaming load costs no request (its worker hands its requests back, the router resumes them on the
other worker) and its group is back, with new rank processes, within 60 s; the restart is counted. A model whose
tensor-parallel size does not divide it fails to load with the reason while another model serves."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from harness.servers import copy_models, start_strata
from harness.waiting import wait_for
from tests.server.test_workers import metric_lines

pytestmark = pytest.mark.slow
PROMPTS = [f"Write a short story about lighthouse number {i}:" for i in range(4)]
TOKENS = 24


TRACE_ID = "31415926535897932384626433832795"


@pytest.fixture(scope="module")
def server(tmp_path_factory, collector):
    tmp = tmp_path_factory.mktemp("sharded")
    process = start_strata(
        copy_models(tmp / "repo", "smollm2"), tmp, "--workers", "2", "--tensor-parallel-size", "3", "--no-kvbm",
        "--otlp-traces-endpoint", collector.url, ready_timeout_s=300, env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
    )  # fmt: skip
    yield process
    process.stop()


@pytest.fixture
def client(server):
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="unused", timeout=300, max_retries=0
    ) as client:
        yield client


def titled(prefix: str) -> dict[str, int]:
    """Processes whose title starts with `prefix`: title -> pid (setproctitle rewrites /proc/<pid>/cmdline)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if title.startswith(prefix):
            found[title] = int(entry.name)
    return found


def test_every_rank_is_a_named_process_with_its_series(server):
    ranks = titled("strata smollm2 worker ")
    assert sorted(ranks) == [f"strata smollm2 worker {w} rank {r}/3" for w in range(2) for r in range(3)]
    up = metric_lines(server, "strata_rank_up{")
    assert len(up) == 6 and set(up.values()) == {1.0}
    memory = metric_lines(server, "strata_rank_resident_memory_bytes{")
    assert len(memory) == 6 and all(value > 50e6 for value in memory.values())


def test_a_traced_prompt_has_a_span_from_every_rank_of_its_worker(client, collector):
    answer = client.completions.create(
        model="smollm2", prompt=PROMPTS[0], max_tokens=2, temperature=0,
        extra_headers={"traceparent": f"00-{TRACE_ID}-{'2' * 16}-01"},
    )  # fmt: skip
    spans = collector.wait_for(
        lambda spans: (
            {"strata.engine.request", "strata.rank.step"} <= {s.name for s in spans if s.trace_id == TRACE_ID}
            and sum(s.name == "strata.rank.step" for s in spans if s.trace_id == TRACE_ID) >= 2
        ),
        30,
        what="the engine's and its ranks' spans",
    )
    (engine,) = [s for s in spans if s.trace_id == TRACE_ID and s.name == "strata.engine.request"]
    steps = [s for s in spans if s.trace_id == TRACE_ID and s.name == "strata.rank.step"]
    assert {s.service for s in steps} == {
        f"{engine.service} rank 1",
        f"{engine.service} rank 2",
    }  # rank 0: the driver
    assert all(s.parent_span_id == engine.span_id for s in steps)
    assert {s.attributes["strata.prefill.tokens"] for s in steps} == {answer.usage.prompt_tokens}


def test_a_rank_killed_under_streaming_load_loses_no_request_and_its_group_comes_back(server, client):
    reference = [
        client.completions.create(model="smollm2", prompt=p, max_tokens=TOKENS, temperature=0).choices[0].text
        for p in PROMPTS
    ]
    before = titled("strata smollm2 worker 0 rank ")
    texts: dict[int, list[str]] = {i: [] for i in range(len(PROMPTS))}
    errors: list[BaseException] = []

    def stream(i: int) -> None:
        try:
            for chunk in client.completions.create(
                model="smollm2", prompt=PROMPTS[i], max_tokens=TOKENS, temperature=0, stream=True
            ):
                texts[i].append(chunk.choices[0].text if chunk.choices else "")
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    wait_for(lambda: all(len(t) >= 2 for t in texts.values()), 120, what="every stream under way")
    killed_at = time.monotonic()
    os.kill(before["strata smollm2 worker 0 rank 1/3"], signal.SIGKILL)
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    assert ["".join(texts[i]) for i in range(len(PROMPTS))] == reference  # greedy: as if nothing happened

    def back() -> bool:
        now = titled("strata smollm2 worker 0 rank ")
        renewed = [
            now.get(title) not in (None, before[title]) for title in before if not title.endswith("0/3")
        ]
        up = metric_lines(server, "strata_rank_up{")
        return len(now) == 3 and all(renewed) and len(up) == 6 and set(up.values()) == {1.0}

    wait_for(back, 60 - (time.monotonic() - killed_at), what="worker 0's group back with new ranks")
    assert metric_lines(server, "strata_worker_restarts_total") == {
        'strata_worker_restarts_total{model="smollm2",reason="SIGKILL"}': 1.0
    }
    log = server.log()
    assert re.search(r"rank 1: exited on SIGKILL", log), log[-3000:]
    answer = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0)
    assert answer.choices[0].text == reference[0]


def test_a_tensor_parallel_size_that_does_not_divide_the_model_fails_its_load_only(strata, tmp_path):
    repo = copy_models(tmp_path / "repo", "smollm2", "add_sub")
    model_json = repo / "smollm2" / "1" / "model.json"
    model_json.write_text(json.dumps({**json.loads(model_json.read_text()), "tensor_parallel_size": 2}))
    server = strata(repo)
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/repository/index", data=b"{}", method="POST"
    )
    rows = {row["name"]: row for row in json.loads(urllib.request.urlopen(request, timeout=10).read())}
    assert rows["smollm2"]["state"] == "UNAVAILABLE", rows
    reason = rows["smollm2"]["reason"]
    assert "tensor_parallel_size 2 does not divide the model's num_attention_heads (9)" in reason, reason
    assert rows["add_sub"]["state"] == "READY"
    ready = urllib.request.urlopen(f"http://{server.http_url}/v2/models/add_sub/ready", timeout=10)
    assert ready.status == 200
