"""SmolLM2 through real Triton with the vLLM backend's interface: generate, generate_stream, gRPC streaming."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from harness.servers import copy_models, start_strata
from harness.waiting import wait_for

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llm")
    process = start_strata(copy_models(tmp / "repo", "smollm2"), tmp)
    yield process
    process.stop()


def post(server, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://{server.http_url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


ALL_OUTPUTS = {
    "return_finish_reason": True,
    "return_num_input_tokens": True,
    "return_num_output_tokens": True,
    "return_num_cached_tokens": True,
}
OPTIONAL_OUTPUTS = ("finish_reason", "num_input_tokens", "num_output_tokens", "num_cached_tokens")


def test_generate_endpoint(server):
    status, body = post(
        server,
        "/v2/models/smollm2/generate",
        {"text_input": PROMPT, **ALL_OUTPUTS, "parameters": {"temperature": 0, "max_tokens": 12}},
    )
    assert status == 200, body
    answer = json.loads(body)
    assert answer["text_output"].startswith(PROMPT) and len(answer["text_output"]) > len(PROMPT)
    assert answer["finish_reason"] == "length"
    assert answer["num_output_tokens"] == 12 and answer["num_input_tokens"] > 0
    assert 0 <= answer["num_cached_tokens"] <= answer["num_input_tokens"]

    status, body = post(
        server,
        "/v2/models/smollm2/generate",
        {
            "text_input": PROMPT,
            "exclude_input_in_output": True,
            "parameters": {"temperature": 0, "max_tokens": 12},
        },
    )
    assert json.loads(body)["text_output"] == answer["text_output"][len(PROMPT) :]


def test_optional_outputs_only_when_asked_for(server):
    params = {"temperature": 0, "max_tokens": 3}
    _, body = post(server, "/v2/models/smollm2/generate", {"text_input": PROMPT, "parameters": params})
    assert set(json.loads(body)) == {"model_name", "model_version", "text_output"}
    for flag, output in zip(ALL_OUTPUTS, OPTIONAL_OUTPUTS, strict=True):
        _, body = post(
            server, "/v2/models/smollm2/generate", {"text_input": PROMPT, flag: True, "parameters": params}
        )
        assert set(json.loads(body)) - {"model_name", "model_version"} == {"text_output", output}, flag
        _, body = post(
            server, "/v2/models/smollm2/generate", {"text_input": PROMPT, flag: False, "parameters": params}
        )
        assert output not in json.loads(body), flag


def test_generate_stream_endpoint_matches_non_streaming(server):
    params = {"temperature": 0, "max_tokens": 10}
    _, whole = post(
        server,
        "/v2/models/smollm2/generate",
        {"text_input": PROMPT, "exclude_input_in_output": True, "parameters": params},
    )
    status, body = post(
        server,
        "/v2/models/smollm2/generate_stream",
        {
            "text_input": PROMPT,
            "stream": True,
            "return_finish_reason": True,
            "return_num_output_tokens": True,
            "parameters": params,
        },
    )
    assert status == 200
    events = [json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")]
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == json.loads(whole)["text_output"]
    # as in the vLLM backend: each response counts its own tokens; the reason is "None" until the last
    assert sum(e["num_output_tokens"] for e in events) == 10
    assert [e["finish_reason"] for e in events] == ["None"] * (len(events) - 1) + ["length"]


def test_cumulative_logprob_and_logprobs_on_the_generate_endpoints(server):
    """The vLLM backend's return_cumulative_logprob, and Strata's return_logprobs: streamed, each response carries
    its own tokens' logprobs and the running sum; the sum of a stream equals the whole answer's."""
    params = {"temperature": 0, "max_tokens": 6, "logprobs": 2}
    flags = {"return_cumulative_logprob": True, "return_logprobs": True, "exclude_input_in_output": True}
    status, whole = post(
        server, "/v2/models/smollm2/generate", {"text_input": PROMPT, **flags, "parameters": params}
    )
    assert status == 200, whole
    answer = json.loads(whole)
    tokens = json.loads(answer["logprobs"])
    assert len(tokens) == 6 and all(len(t["top_logprobs"]) == 2 for t in tokens)
    assert "".join(t["decoded_token"] for t in tokens) == answer["text_output"]
    assert abs(answer["cumulative_logprob"] - sum(t["logprob"] for t in tokens)) < 1e-4
    status, body = post(
        server,
        "/v2/models/smollm2/generate_stream",
        {"text_input": PROMPT, "stream": True, **flags, "parameters": params},
    )
    events = [json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")]
    streamed = [t for e in events for t in json.loads(e["logprobs"])]
    assert [t["token_id"] for t in streamed] == [t["token_id"] for t in tokens]
    assert abs(events[-1]["cumulative_logprob"] - answer["cumulative_logprob"]) < 1e-4


def test_structured_outputs_in_sampling_parameters(server):
    """vLLM's structured_outputs in Triton's sampling_parameters (as the vLLM backend passes them to vLLM); a bad
    one is a 400 naming it, never ignored."""
    params = {"max_tokens": 8, "temperature": 1.0, "structured_outputs": {"choice": ["yes", "no"]}}
    for _ in range(2):
        status, body = post(
            server,
            "/v2/models/smollm2/generate",
            {
                "text_input": PROMPT,
                "exclude_input_in_output": True,
                "sampling_parameters": json.dumps(params),
            },
        )
        assert status == 200, body
        assert json.loads(body)["text_output"] in ("yes", "no")
    bad = {"max_tokens": 4, "structured_outputs": {"regex": "a(b"}}
    status, body = post(
        server, "/v2/models/smollm2/generate", {"text_input": PROMPT, "sampling_parameters": json.dumps(bad)}
    )
    assert status == 400 and "structured_outputs.regex" in body, body


def test_streaming_with_the_prompt_in_the_output_is_rejected(server):
    status, body = post(
        server,
        "/v2/models/smollm2/generate_stream",
        {
            "text_input": PROMPT,
            "stream": True,
            "exclude_input_in_output": False,
            "parameters": {"max_tokens": 2},
        },
    )
    assert status == 400 and "exclude_input_in_output" in body, body


def stream_over_grpc(server, requests: dict[str, dict[str, tuple[np.ndarray, str]]]) -> dict[str, list]:
    """Send each request (id -> inputs) on one gRPC stream; every non-final response of each, by id."""
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for request_id, named in requests.items():
            inputs = []
            for name, (value, dtype) in named.items():
                tensor = grpcclient.InferInput(name, [1], dtype)
                tensor.set_data_from_numpy(value)
                inputs.append(tensor)
            client.async_stream_infer(
                "smollm2", inputs, request_id=request_id, enable_empty_final_response=True
            )
        results: dict[str, list] = {request_id: [] for request_id in requests}
        finished = set()
        while len(finished) < len(requests):
            result, error = responses.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                finished.add(response.id)
            else:
                results[response.id].append(result)
        return results
    finally:
        client.stop_stream()
        client.close()


def grpc_inputs(max_tokens: int, **flags: bool) -> dict[str, tuple[np.ndarray, str]]:
    sampling = json.dumps({"temperature": 0, "max_tokens": max_tokens}).encode()
    return {
        "text_input": (np.array([PROMPT.encode()], dtype=object), "BYTES"),
        "stream": (np.array([True]), "BOOL"),
        "sampling_parameters": (np.array([sampling], dtype=object), "BYTES"),
        **{name: (np.array([value]), "BOOL") for name, value in flags.items()},
    }


def test_grpc_streaming_with_sampling_parameters(server):
    results = stream_over_grpc(server, {"a": grpc_inputs(6), "b": grpc_inputs(6)})
    texts = {
        request_id: "".join(r.as_numpy("text_output")[0].decode() for r in got)
        for request_id, got in results.items()
    }
    assert texts["a"] == texts["b"] and texts["a"]
    assert all(r.as_numpy(name) is None for got in results.values() for r in got for name in OPTIONAL_OUTPUTS)


def test_grpc_streaming_sends_the_optional_outputs_asked_for(server):
    results = stream_over_grpc(
        server,
        {
            "all": grpc_inputs(6, **ALL_OUTPUTS),
            "some": grpc_inputs(6, return_finish_reason=True, return_num_output_tokens=False),
        },
    )
    every = results["all"]
    assert all(all(r.as_numpy(name) is not None for name in OPTIONAL_OUTPUTS) for r in every)
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in every) == 6
    assert every[-1].as_numpy("finish_reason")[0] == b"length"
    assert len({int(r.as_numpy("num_input_tokens")[0]) for r in every}) == 1
    some = results["some"]
    assert all(
        r.as_numpy("finish_reason") is not None and r.as_numpy("num_output_tokens") is None for r in some
    )


def test_cached_prefix_is_reported(server):
    long_prompt = "Strata serves models from a repository. " * 20
    params = {"temperature": 0, "max_tokens": 2}
    body = {
        "text_input": long_prompt,
        "return_num_cached_tokens": True,
        "return_num_input_tokens": True,
        "parameters": params,
    }
    first = json.loads(post(server, "/v2/models/smollm2/generate", body)[1])
    second = json.loads(post(server, "/v2/models/smollm2/generate", body)[1])
    assert first["num_cached_tokens"] == 0 or first["num_cached_tokens"] < second["num_cached_tokens"]
    assert second["num_cached_tokens"] >= second["num_input_tokens"] - 16


def test_cache_salt_keeps_tenants_apart(server):
    """`cache_salt` as a request parameter or inside sampling_parameters: a prompt's cached blocks are shared only
    among requests with the same salt (no salt being one more tenant)."""
    prompt = "Each tenant's prompts stay its own in the prefix cache. " * 12

    def cached(cache_salt: str | None, in_sampling_parameters: bool = False) -> tuple[int, int]:
        params = {"temperature": 0, "max_tokens": 2}
        body = {"text_input": prompt, "return_num_cached_tokens": True, "return_num_input_tokens": True}
        salt = {"cache_salt": cache_salt} if cache_salt else {}
        if in_sampling_parameters:
            body["sampling_parameters"] = json.dumps({**params, **salt})
        else:
            body["parameters"] = {**params, **salt}
        status, answer = post(server, "/v2/models/smollm2/generate", body)
        assert status == 200, answer
        return json.loads(answer)["num_cached_tokens"], json.loads(answer)["num_input_tokens"]

    assert cached(None)[0] == 0
    assert cached("tenant-a")[0] == 0
    assert cached("tenant-b", in_sampling_parameters=True)[0] == 0
    for again in (cached("tenant-a", in_sampling_parameters=True), cached("tenant-b"), cached(None)):
        assert again[0] >= again[1] - 16, again


@pytest.mark.parametrize(
    "parameters, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"bogus": 1}, "bogus"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": 5}, "cache_salt"),
        ({"cache_salt": "x" * 257}, "cache_salt"),
        ({"priority": "high"}, "priority"),
        ({"priority": 3}, "priority"),  # reaches the engine, whose scheduling_policy is fcfs
    ],
)
def test_bad_request_names_the_field(server, parameters, field):
    status, body = post(server, "/v2/models/smollm2/generate", {"text_input": "hi", "parameters": parameters})
    assert status == 400
    assert field in body and "Traceback" not in body
    status, _ = post(
        server,
        "/v2/models/smollm2/generate",
        {"text_input": "hi", "parameters": {"temperature": 0, "max_tokens": 2}},
    )
    assert status == 200


def test_poll_mode_reloads_an_edited_llm_and_keeps_serving(tmp_path_factory):
    """An edited model.json re-binds the LLM; the server must not read the moment of re-binding as a crash."""
    tmp = tmp_path_factory.mktemp("poll")  # short: PyTriton's unix socket paths live under it
    repo = copy_models(tmp / "repo", "smollm2")
    server = start_strata(
        repo, tmp, "--model-control-mode", "poll", "--repository-poll-secs", "0.3", wait_ready=True
    )
    try:
        _reload_and_check(server, repo)
    finally:
        server.stop()


def _reload_and_check(server, repo) -> None:
    body = {"text_input": PROMPT, "parameters": {"temperature": 0, "max_tokens": 2}}
    wait_for(lambda: "smollm2: serving version" in server.log(), 120, what="the first load")
    assert post(server, "/v2/models/smollm2/generate", body)[0] == 200
    settings_path = repo / "smollm2" / "1" / "model.json"
    settings_path.write_text(json.dumps({**json.loads(settings_path.read_text()), "max_tokens_limit": 100}))
    wait_for(lambda: server.log().count("smollm2: serving version") > 1, 120, what="the reload")
    status, answer = post(server, "/v2/models/smollm2/generate", body)
    assert status == 200, answer
    assert "exited unexpectedly" not in server.log()
    assert server.process.poll() is None


def test_a_full_wait_queue_refuses_on_triton_and_is_429_on_openai(tmp_path_factory):
    """One request running, one waiting (--max-queued-requests 1): the next is refused, not queued; Triton's
    generate names TritonUnavailableError (it answers 400 to every model error), the OpenAI API 429 with
    Retry-After."""
    tmp = tmp_path_factory.mktemp("full")
    server = start_strata(
        copy_models(tmp / "repo", "smollm2"),
        tmp,
        "--max-concurrent-requests",
        "1",
        "--max-queued-requests",
        "1",
    )
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="unused", max_retries=0
    )
    try:
        running = client.completions.create(
            model="smollm2", prompt=PROMPT, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(running))  # it produced a token: it holds the one slot
        waiting = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, stream=True)
        status, body = post(server, "/v2/models/smollm2/generate", {"text_input": PROMPT})
        assert status == 400 and "TritonUnavailableError: " in body and "max_queued_requests" in body, body
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2)
        assert int(refused.value.response.headers["retry-after"]) >= 1
        running.close()
        assert "".join(c.choices[0].text for c in waiting)  # the waiting one still gets its answer
        status, _ = post(
            server, "/v2/models/smollm2/generate", {"text_input": PROMPT, "parameters": {"max_tokens": 2}}
        )
        assert status == 200
    finally:
        server.stop()
