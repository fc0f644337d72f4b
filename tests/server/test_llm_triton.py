"""SmolLM2 through real Triton with the vLLM backend's interface: generate, generate_stream, gRPC streaming."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import copy_models, start_strata

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llm")
    process = start_strata(copy_models(tmp / "repo", "smollm2"), tmp)
    yield process
    process.stop()


def post(server, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_generate_endpoint(server):
    status, body = post(server, "/v2/models/smollm2/generate",
                        {"text_input": PROMPT, "parameters": {"temperature": 0, "max_tokens": 12}})
    assert status == 200, body
    answer = json.loads(body)
    assert answer["text_output"].startswith(PROMPT) and len(answer["text_output"]) > len(PROMPT)
    assert answer["finish_reason"] == "length"
    assert answer["num_output_tokens"] == 12 and answer["num_input_tokens"] > 0

    status, body = post(server, "/v2/models/smollm2/generate",
                        {"text_input": PROMPT, "exclude_input_in_output": True,
                         "parameters": {"temperature": 0, "max_tokens": 12}})
    assert json.loads(body)["text_output"] == answer["text_output"][len(PROMPT):]


def test_generate_stream_endpoint_matches_non_streaming(server):
    params = {"temperature": 0, "max_tokens": 10}
    _, whole = post(server, "/v2/models/smollm2/generate",
                    {"text_input": PROMPT, "exclude_input_in_output": True, "parameters": params})
    status, body = post(server, "/v2/models/smollm2/generate_stream",
                        {"text_input": PROMPT, "stream": True, "parameters": params})
    assert status == 200
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == json.loads(whole)["text_output"]
    assert events[-1]["finish_reason"] == "length" and events[-1]["num_output_tokens"] == 10


def test_grpc_streaming_with_sampling_parameters(server):
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for request_id in ("a", "b"):
            inputs = []
            for name, value, dtype in (("text_input", np.array([PROMPT.encode()], dtype=object), "BYTES"),
                                       ("stream", np.array([True]), "BOOL"),
                                       ("sampling_parameters",
                                        np.array([json.dumps({"temperature": 0, "max_tokens": 6}).encode()],
                                                 dtype=object), "BYTES")):
                tensor = grpcclient.InferInput(name, [1], dtype)
                tensor.set_data_from_numpy(value)
                inputs.append(tensor)
            client.async_stream_infer("smollm2", inputs, request_id=request_id, enable_empty_final_response=True)
        texts: dict[str, list[str]] = {"a": [], "b": []}
        finished = set()
        while len(finished) < 2:
            result, error = responses.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                finished.add(response.id)
                continue
            texts[response.id].append(result.as_numpy("text_output")[0].decode())
        assert "".join(texts["a"]) == "".join(texts["b"]) and texts["a"]
    finally:
        client.stop_stream()
        client.close()


def test_cached_prefix_is_reported(server):
    long_prompt = "Strata serves models from a repository. " * 20
    params = {"temperature": 0, "max_tokens": 2}
    first = json.loads(post(server, "/v2/models/smollm2/generate", {"text_input": long_prompt, "parameters": params})[1])
    second = json.loads(post(server, "/v2/models/smollm2/generate", {"text_input": long_prompt, "parameters": params})[1])
    assert first["num_cached_tokens"] == 0 or first["num_cached_tokens"] < second["num_cached_tokens"]
    assert second["num_cached_tokens"] >= second["num_input_tokens"] - 16


@pytest.mark.parametrize("parameters, field", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                               ({"max_tokens": 0}, "max_tokens"), ({"bogus": 1}, "bogus")])
def test_bad_request_names_the_field(server, parameters, field):
    status, body = post(server, "/v2/models/smollm2/generate", {"text_input": "hi", "parameters": parameters})
    assert status == 400
    assert field in body and "Traceback" not in body
    status, _ = post(server, "/v2/models/smollm2/generate",
                     {"text_input": "hi", "parameters": {"temperature": 0, "max_tokens": 2}})
    assert status == 200
