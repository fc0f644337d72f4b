"""`strata serve --prefill-workers 1 --decode-workers 1`: OpenAI and Triton clients against disaggregated workers,
the thresholds changed while serving, the decisions and transfers on /metrics, and bad role flags refused."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import httpx
import openai
import pytest

from harness.servers import copy_models, run_cli, start_strata

pytestmark = pytest.mark.slow

LONG = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined a "
    * 8
)


TRACE_ID = "0123456789abcdef0123456789abcdef"
CLIENT_SPAN = "0011223344556677"


@pytest.fixture(scope="module")
def server(tmp_path_factory, collector):
    tmp = tmp_path_factory.mktemp("disagg")
    process = start_strata(
        copy_models(tmp / "repo", "smollm2"), tmp, "--prefill-workers", "1", "--decode-workers", "1",
        "--max-local-prefill-length", "64", "--otlp-traces-endpoint", collector.url,
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
    )  # fmt: skip
    yield process
    process.stop()


@pytest.fixture
def client(server):
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="unused", timeout=120, max_retries=0
    ) as client:
        yield client


def prefills(server) -> dict[str, float]:
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{server.openai_port}/metrics", timeout=10).read().decode()
    )
    rows = {}
    for line in text.splitlines():
        if line.startswith(
            ("strata_disagg_prefills_total", "strata_workers{", "strata_disagg_kv_transfer_bytes")
        ):
            labels, value = line.rsplit(" ", 1)
            rows[labels] = float(value)
    return rows


def streamed_text(client, prompt: str, **extra) -> str:
    chunks = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=16, temperature=0, stream=True, extra_body=extra or None
    )
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


def test_remote_and_local_prefill_answer_alike_over_openai_and_triton(client, server):
    before = prefills(server)
    remote = streamed_text(client, LONG)
    after = prefills(server)
    key = 'strata_disagg_prefills_total{model="smollm2",reason="long_prompt",where="remote"}'
    assert after[key] == before.get(key, 0) + 1
    assert after['strata_workers{model="smollm2",role="prefill"}'] == 1
    assert after['strata_workers{model="smollm2",role="decode"}'] == 1
    assert after['strata_disagg_kv_transfer_bytes_total{model="smollm2",transport="shm"}'] > 0
    # the same prompt under another cache salt is uncached everywhere; past a raised threshold, prefilled locally
    base = f"http://127.0.0.1:{server.openai_port}/v1/strata/models/smollm2/disagg"
    raised = httpx.put(base, json={"max_local_prefill_length": 100000}, timeout=10)
    assert raised.status_code == 200 and raised.json() == {
        "max_local_prefill_length": 100000,
        "max_prefill_queue_size": 4,
    }
    local = streamed_text(client, LONG, cache_salt="tenant-b")
    assert local == remote
    short = 'strata_disagg_prefills_total{model="smollm2",reason="short_prompt",where="local"}'
    assert prefills(server)[short] >= 1
    assert httpx.put(base, json={"max_local_prefill_length": 64}, timeout=10).status_code == 200
    generated = httpx.post(
        f"http://127.0.0.1:{server.http_port}/v2/models/smollm2/generate",
        json={"text_input": LONG, "exclude_input_in_output": True,  # another salt: uncached, prefilled remotely
              "parameters": {"temperature": 0, "max_tokens": 16, "cache_salt": "tenant-c"}},
        timeout=120,
    )  # fmt: skip
    assert generated.status_code == 200, generated.text
    assert generated.json()["text_output"] == remote


def test_a_remotely_prefilled_request_is_one_trace_over_both_workers(client, collector):
    chunks = client.completions.create(
        model="smollm2", prompt=LONG, max_tokens=8, temperature=0, stream=True,
        extra_body={"cache_salt": "traced"},  # uncached on both workers: prefilled remotely
        extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
    )  # fmt: skip
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    collector.wait_for(
        lambda spans: (
            sum(s.trace_id == TRACE_ID and s.name == "strata.engine.request" for s in spans) == 2
            and any(s.trace_id == TRACE_ID and s.name == "POST /v1/completions" for s in spans)
        ),
        30,
        what="both workers' request spans",
    )
    spans = collector.trace(TRACE_ID)
    router = {s.name: s for s in spans if s.service == "server"}
    generation = router["text_completion smollm2"]
    assert router["strata.router.place"].parent_span_id == generation.span_id
    prefill, decode = router["strata.router.prefill"], router["strata.router.decode"]
    assert prefill.parent_span_id == router["strata.router.place"].span_id
    assert decode.parent_span_id == generation.span_id and decode.attributes["strata.kv_handoff"] is True
    assert prefill.attributes["strata.worker.id"] == "smollm2-p0"
    assert decode.attributes["strata.worker.id"] == "smollm2-d1"
    engines = {s.service: s for s in spans if s.name == "strata.engine.request"}
    assert engines["smollm2-p0"].parent_span_id == prefill.span_id
    assert engines["smollm2-p0"].attributes["strata.finish_reason"] == "handed_off"
    assert engines["smollm2-d1"].parent_span_id == decode.span_id
    assert engines["smollm2-d1"].attributes["strata.finish_reason"] == "length"
    prefilled = [s for s in spans if s.name == "strata.engine.prefill"]
    assert {s.service for s in prefilled} == {
        "smollm2-p0",
        "smollm2-d1",
    }  # the decode side: the partial block


def test_thresholds_are_checked_and_only_disaggregated_models_have_them(server):
    base = f"http://127.0.0.1:{server.openai_port}/v1/strata/models"
    bad = httpx.put(f"{base}/smollm2/disagg", json={"max_prefill_queue_size": -1}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_prefill_queue_size"
    unknown = httpx.put(f"{base}/smollm2/disagg", json={"max_queue": 3}, timeout=10)
    assert unknown.status_code == 400
    missing = httpx.get(f"{base}/nope/disagg", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{base}/smollm2/disagg", timeout=10).json()["max_prefill_queue_size"] == 4


def test_role_flags_are_checked(tmp_path: Path) -> None:
    repository = copy_models(tmp_path / "repo", "smollm2")
    both = run_cli("serve", "--model-repository", str(repository), "--workers", "2", "--prefill-workers", "1")
    assert both.returncode == 2 and "--prefill-workers" in both.stderr
    negative = run_cli("serve", "--model-repository", str(repository), "--prefill-workers", "-1")
    assert negative.returncode == 2 and "--prefill-workers: must be >= 0" in negative.stderr
