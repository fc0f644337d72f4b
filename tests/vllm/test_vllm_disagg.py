"""Disaggregated prefill/decode on backend vllm: a vLLM prefill worker computes a long prompt and its first token,
its StrataKVConnector has written the prompt's blocks through to the node's G2, and a vLLM decode worker loads them
from there instead of prefilling (real vLLM in the venv `make vllm` builds, real Strata server).

The reference answer is Strata's own engine on the same model in fp32 (greedy), which the aggregated vLLM tests
already hold equal to vLLM's.
"""

from __future__ import annotations

import json
import uuid

import openai
import pytest

from harness.servers import copy_models, start_strata
from kvbm.host_pool import remove_segments
from server.engine.config import DEFAULT_MODEL
from server.engine.loader import prepare_model
from tests.server.test_workers import metric_lines

pytestmark = pytest.mark.slow

DISAGG_CONFIG = """backend: "vllm"
parameters { key: "prefill_workers" value { string_value: "1" } }
parameters { key: "decode_workers" value { string_value: "1" } }
"""
LONG_PROMPT = (
    "The history of tea begins in southwest China, where the plant was first used as a medicine. Over the "
    "centuries it became a daily drink, then a trade good carried along caravan routes to Tibet and Central "
    "Asia, and later by sea to Europe. "
) * 12  # ~600 tokens: four full blocks of 128 and a partial one


@pytest.fixture(scope="module")
def server(tmp_path_factory, vllm_python):
    tmp = tmp_path_factory.mktemp("vdisagg")
    repo = copy_models(tmp / "repo", "smollm2")
    (repo / "smol_vllm" / "1").mkdir(parents=True)
    (repo / "smol_vllm" / "config.pbtxt").write_text(DISAGG_CONFIG)
    model_json = {
        "model": str(prepare_model(DEFAULT_MODEL).folder), "enforce_eager": True, "dtype": "float32",
        "kv_cache_memory_bytes": 128 << 20, "max_model_len": 2048,
    }  # fmt: skip
    (repo / "smol_vllm" / "1" / "model.json").write_text(json.dumps(model_json))
    cache_id = (
        f"test-{uuid.uuid4().hex[:8]}"  # the node's G2: where the prefill worker leaves the prompt's KV
    )
    process = start_strata(
        repo, tmp, "--vllm-python", vllm_python, "--kvbm-host-cache-gb", "0.25", "--kvbm-cache-id", cache_id,
        "--max-local-prefill-length", "256", ready_timeout_s=400,
    )  # fmt: skip
    yield process
    process.stop()
    remove_segments(cache_id)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="-", timeout=300, max_retries=0
    ) as client:
        yield client


def metric(server, name: str, **labels: str) -> float:
    """The sample of `name` whose labels include `labels` (0 if none)."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    rows = metric_lines(server, name)
    return next((value for key, value in rows.items() if all(w in key for w in wanted)), 0.0)


def answer(client, model: str, prompt: str, max_tokens: int = 8):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)


def test_a_long_prompt_is_prefilled_remotely_and_decoded_from_the_handed_over_blocks(client, server):
    expected = answer(client, "smollm2", LONG_PROMPT)
    got = answer(client, "smol_vllm", LONG_PROMPT)
    assert got.choices[0].text == expected.choices[0].text
    assert got.usage.completion_tokens == 8 and got.usage.prompt_tokens == expected.usage.prompt_tokens
    remote = dict(model="smol_vllm", where="remote", reason="long_prompt")
    assert metric(server, "strata_disagg_prefills_total", **remote) == 1
    full_blocks = expected.usage.prompt_tokens // 128
    sent = metric(server, "strata_disagg_kv_transfer_bytes_total", model="smol_vllm", transport="kvbm")
    assert (
        sent == full_blocks * 2 * 30 * 3 * 64 * 128 * 4
    )  # K and V, 30 layers, 3 KV heads x 64, 128 tokens, fp32
    # the decode worker had never seen the prompt: what it did not compute came through G2
    assert metric(server, "strata_disagg_kv_transfer_seconds_count", model="smol_vllm", side="receive") == 1


def test_short_prompts_and_streams_stay_on_the_decode_worker(client, server):
    short = answer(client, "smol_vllm", "The three primary colors are", max_tokens=6)
    assert (
        short.choices[0].text == answer(client, "smollm2", "The three primary colors are", 6).choices[0].text
    )
    stream = client.completions.create(
        model="smol_vllm", prompt="Once more: " + LONG_PROMPT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    remote = dict(model="smol_vllm", where="remote", reason="long_prompt")
    assert metric(server, "strata_disagg_prefills_total", **remote) == 2
    assert metric(server, "strata_disagg_kv_transfer_seconds_count", model="smol_vllm", side="receive") == 2
