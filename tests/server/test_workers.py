"""`strata serve --workers 2`: the openai client and tritonclient against the same routed workers."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from harness.otlp import OTLPReceiver, ReceivedSpan
from harness.servers import copy_models, start_strata
from harness.waiting import wait_for

pytestmark = pytest.mark.slow

SHARED_PREFIX = "You are a careful assistant who answers about model serving. " * 12


TRACE_ID = "5c3e1a2b9d8f4e6a8b7c6d5e4f3a2b1c"
CLIENT_SPAN = "a1b2c3d4e5f60718"


@pytest.fixture(scope="module")
def server(tmp_path_factory, collector):
    """Traced: every process exports to `collector` (spans batched for 0.1 s, so a worker killed in a test has sent
    what it finished)."""
    tmp = tmp_path_factory.mktemp("workers")
    process = start_strata(
        copy_models(tmp / "repo", "smollm2"), tmp, "--workers", "2", "--no-kvbm",
        "--otlp-traces-endpoint", collector.url, env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
    )  # fmt: skip
    yield process
    process.stop()


@pytest.fixture
def client(server):
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="unused", timeout=120, max_retries=0
    ) as client:
        yield client


def metric_lines(server, name: str) -> dict[str, float]:
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{server.openai_port}/metrics", timeout=10).read().decode()
    )
    rows = {}
    for line in text.splitlines():
        if line.startswith(name):
            labels, value = line.rsplit(" ", 1)
            rows[labels] = float(value)
    return rows


def worker_pids(server) -> list[int]:
    """Engine worker processes, as the server logged them ("worker smollm2-w0 up: pid 367")."""
    return sorted(int(pid) for pid in re.findall(r"worker \S+ up: pid (\d+)", server.log()))


def test_openai_chat_and_completion_streaming(client):
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name a color."}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    chunks = list(
        client.completions.create(
            model="smollm2",
            prompt="Counting: one, two,",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 6
    models = [m.id for m in client.models.list()]
    assert models == ["smollm2"]


def test_tritonclient_streaming_on_the_same_workers(server, collector):
    outputs = []
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    grpc.start_stream(callback=lambda result, error: outputs.append((result, error)))
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"The sky is"], dtype=object))
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(
        np.array([json.dumps({"max_tokens": 5, "temperature": 0}).encode()], dtype=object)
    )
    grpc.async_stream_infer("smollm2", [text, stream, params], enable_empty_final_response=True)
    wait_for(
        lambda: any(
            r is not None and r.get_response().parameters["triton_final_response"].bool_param
            for r, _ in outputs
        ),
        120,
        what="final streamed response",
    )
    grpc.stop_stream()
    grpc.close()
    assert all(error is None for _, error in outputs)
    assert "".join(
        r.as_numpy("text_output")[0].decode()
        for r, _ in outputs
        if not r.get_response().parameters["triton_final_response"].bool_param
    )
    # --otlp-traces-endpoint without --trace-config: Triton's own OpenTelemetry mode sends to the same collector
    collector.wait_for(
        lambda spans: any(s.service == "triton-inference-server" and s.name == "smollm2" for s in spans),
        30,
        what="Triton's span of the smollm2 request",
    )


def test_shared_prefix_goes_where_it_is_cached(client, server):
    before = metric_lines(server, "strata_router_decisions_total")
    first = client.completions.create(
        model="smollm2", prompt=SHARED_PREFIX + "Question one?", max_tokens=2, temperature=0
    )
    second = client.completions.create(
        model="smollm2", prompt=SHARED_PREFIX + "Question two?", max_tokens=2, temperature=0
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.8 * first.usage.prompt_tokens
    after = metric_lines(server, "strata_router_decisions_total")
    assert sum(after.values()) - sum(before.values()) == 2


def test_bad_requests_are_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=0
        )
    assert raised.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_killed_worker_is_routed_around_and_its_stream_migrates(client, server, collector):
    request = dict(
        model="smollm2", prompt="Write a long story about a lighthouse keeper:", max_tokens=40, temperature=0
    )
    reference = client.completions.create(**request).choices[0].text
    pids = dict(re.findall(r"worker (\S+) up: pid (\d+)", server.log()))
    assert len(pids) == 2
    stream = client.completions.create(
        **request,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
    )
    chunks = [next(stream) for _ in range(4)]
    busy = [
        labels for labels, value in metric_lines(server, "strata_router_worker_in_flight").items() if value
    ]
    holder = re.search(r'worker="([^"]+)"', busy[0]).group(1)
    collector.wait_for(  # its prefill span has left the worker (its request span ends only with the request)
        lambda spans: any(s.trace_id == TRACE_ID and s.service == holder for s in spans),
        10,
        what="a prefill span",
    )
    os.kill(int(pids[holder]), signal.SIGKILL)
    chunks += list(stream)  # the same stream goes on: resumed on the other worker
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].usage.completion_tokens == 40
    assert text == reference  # greedy: the resumed answer is the one the dead worker would have given
    assert metric_lines(server, "strata_router_migrations_total") == {
        f'strata_router_migrations_total{{worker="{holder}"}}': 1.0
    }
    assert_one_trace_over_both_workers(collector, holder, (set(pids) - {holder}).pop())
    wait_for(
        lambda: len(metric_lines(server, "strata_router_worker_in_flight")) == 1, 30, what="worker dropped"
    )
    assert "left the router" in server.log()
    for i in range(4):
        answer = client.completions.create(
            model="smollm2", prompt=f"Request {i} after a crash:", max_tokens=3, temperature=0
        )
        assert answer.usage.completion_tokens == 3


def assert_one_trace_over_both_workers(collector: OTLPReceiver, dead: str, other: str) -> None:
    """The migrated request's trace: the client's span -> the frontend's server and GenAI spans -> the placement on
    `dead` (whose prefill span it sent before dying) and the migration -> `other`'s engine spans."""

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = {(s.service, s.name) for s in spans if s.trace_id == TRACE_ID}
        return {("server", "POST /v1/completions"), (other, "strata.engine.request")} <= names

    collector.wait_for(complete, 30, what="the migrated request's spans")
    spans = collector.trace(TRACE_ID)
    one = {s.name: s for s in spans if s.service == "server"}
    assert one["POST /v1/completions"].parent_span_id == CLIENT_SPAN
    generation = one["text_completion smollm2"]
    assert generation.parent_span_id == one["POST /v1/completions"].span_id
    assert generation.attributes["gen_ai.usage.output_tokens"] == 40
    place, migrate = one["strata.router.place"], one["strata.router.migrate"]
    assert place.parent_span_id == migrate.parent_span_id == generation.span_id
    assert (
        place.attributes["strata.worker.id"] == dead
        and place.attributes["strata.route.strategy"] == "kv-aware"
    )
    assert (
        migrate.attributes["strata.migration.from"] == dead
        and migrate.attributes["strata.worker.id"] == other
    )
    assert migrate.attributes["strata.migration.tokens_done"] >= 4
    assert "strata.engine.prefill" in {s.name for s in spans if s.service == dead}
    (resumed,) = [s for s in spans if s.service == other and s.name == "strata.engine.request"]
    assert resumed.parent_span_id == migrate.span_id
    assert (
        resumed.attributes["gen_ai.usage.output_tokens"]
        == 40 - migrate.attributes["strata.migration.tokens_done"]
    )
    assert {s.name for s in spans if s.parent_span_id == resumed.span_id} >= {
        "strata.engine.queue",
        "strata.engine.decode",
    }


def test_disconnect_cancels_on_the_worker(client, server):
    stream = client.completions.create(
        model="smollm2", prompt="Write a very long story:", max_tokens=400, temperature=0, stream=True
    )
    for _, _chunk in zip(range(2), stream, strict=False):
        pass
    stream.close()
    wait_for(
        lambda: sum(metric_lines(server, "strata_router_worker_in_flight").values()) == 0,
        30,
        what="request released after the client left",
    )
    aborted = metric_lines(server, "strata_requests_total")
    assert any('status="aborted"' in labels and value >= 1 for labels, value in aborted.items())


def test_pool_series_have_vllm_names_and_the_model_label(server):
    """strata_kv_cache_usage_perc and the queue and preemption series, summed over the workers' reports."""
    usage = metric_lines(server, "strata_kv_cache_usage_perc")
    assert list(usage) == ['strata_kv_cache_usage_perc{model="smollm2"}']
    assert 0.0 <= usage['strata_kv_cache_usage_perc{model="smollm2"}'] <= 1.0
    assert 'strata_num_preemptions_total{model="smollm2"}' in metric_lines(server, "strata_num_preemptions")
    assert 'strata_num_requests_waiting{model="smollm2"}' in metric_lines(
        server, "strata_num_requests_waiting"
    )


def test_workers_exit_when_the_server_is_killed(strata, tmp_path):
    server = strata(
        copy_models(tmp_path / "repo", "smollm2"),
        "--workers",
        "2",
        "--no-kvbm",
        "--model-control-mode",
        "explicit",
        "--load-model",
        "smollm2",
    )
    pids = worker_pids(server)
    assert len(pids) == 2
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(10)
    wait_for(lambda: not any(running(pid) for pid in pids), 30, what="workers gone")


def running(pid: int) -> bool:
    """Alive and not a zombie waiting for its (dead) parent to reap it."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_no_worker_left_is_503_and_unhealthy(client, server):
    """Runs last on the module's server: kills whatever worker is left."""
    for pid in worker_pids(server):
        if running(pid):
            os.kill(pid, signal.SIGKILL)

    def health_status() -> int:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{server.openai_port}/health", timeout=10).status
        except urllib.error.HTTPError as exc:
            return exc.code

    wait_for(lambda: health_status() == 503, 30, what="/health 503")
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(model="smollm2", prompt="anyone there?", max_tokens=2)
    assert raised.value.status_code == 503
    assert raised.value.body["code"] == "engine_unavailable"
