"""The frontend through the official `openai` client and raw HTTP, over a fake engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
import openai
import pytest

from harness.waiting import wait_for
from server.engine.api import EngineOverloaded, GenerationOutput

if TYPE_CHECKING:
    from conftest import Served  # fixtures come from tests/openai/conftest.py


@pytest.fixture
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake"]


def test_chat_completion(client: openai.OpenAI, served: Served) -> None:
    reply = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    assert reply.choices[0].message.content == " t0 t1 t2"
    assert reply.choices[0].finish_reason == "length"
    prompt = len("<user>hi<assistant>")
    assert reply.usage.prompt_tokens == prompt
    assert reply.usage.completion_tokens == 3
    assert reply.usage.total_tokens == prompt + 3
    assert reply.usage.prompt_tokens_details.cached_tokens == 4
    sampling = served.engine.submitted[0].sampling
    assert (sampling.max_tokens, sampling.temperature) == (3, 0.0)
    assert (
        served.engine.submitted[0].request_id == f"{reply.id.removeprefix('chatcmpl-')}-0"
    )  # logs correlate


def test_chat_sampling_fields_reach_the_engine(client: openai.OpenAI, served: Served) -> None:
    client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=5,
        top_p=0.5,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=7,
        stop=["t9"],
        extra_body={"top_k": 20},
    )
    sampling = served.engine.submitted[0].sampling
    assert (sampling.max_tokens, sampling.top_p, sampling.top_k, sampling.seed) == (5, 0.5, 20, 7)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.stop) == (0.5, -0.5, ["t9"])


def test_chat_n_submits_independent_seeded_requests(client: openai.OpenAI, served: Served) -> None:
    reply = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=3, seed=10
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [" t10 t11", " t11 t12", " t12 t13"]
    assert len({r.request_id for r in served.engine.submitted}) == 3
    assert reply.usage.completion_tokens == 6
    assert reply.usage.prompt_tokens == len("<user>hi<assistant>")  # counted once, not per choice


def test_stop_string_ends_the_choice(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=10, stop="t2"
    )
    assert reply.choices[0].message.content == " t0 t1"
    assert reply.choices[0].finish_reason == "stop"


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " t0 t1 t2 t3"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 4


def test_completion_prompt_forms(client: openai.OpenAI) -> None:
    assert client.completions.create(model="fake", prompt="abc", max_tokens=2).choices[0].text == " t0 t1"
    token_reply = client.completions.create(model="fake", prompt=[5, 6, 7], max_tokens=1)
    assert token_reply.usage.prompt_tokens == 3
    many = client.completions.create(model="fake", prompt=["a", "bb"], max_tokens=1, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.usage.prompt_tokens == 3
    lists = client.completions.create(model="fake", prompt=[[1, 2], [3, 4, 5]], max_tokens=1)
    assert lists.usage.prompt_tokens == 5


def test_completion_stream(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="fake", prompt="abc", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == " t0 t1 t2"
    assert chunks[-1].choices[0].finish_reason == "length"


def _post(served: Served, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{served.base_url}{path}", json=body, timeout=10)


def _chat(**fields: object) -> dict[str, object]:
    return {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "fake"}, "messages"),
        ({"model": "fake", "messages": "hi"}, "messages"),
        ({"model": "fake", "messages": []}, "messages"),
        (_chat(max_tokens="ten"), "max_tokens"),
        (_chat(max_tokens=100_000), "max_tokens"),
        (_chat(max_completion_tokens=100_000), "max_completion_tokens"),
        (_chat(temperature=-0.5), "temperature"),
        (_chat(top_p=0), "top_p"),
        (_chat(n=0), "n"),
        (_chat(top_logprobs=3), "top_logprobs"),  # without logprobs: true
        (_chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (_chat(logit_bias={"1": 200}), "logit_bias"),
        (_chat(min_p=2.0), "min_p"),
        (_chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),  # auto: no parser
        (_chat(tool_choice="required"), "tool_choice"),  # no tools
        (
            _chat(
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}},
            ),
            "tool_choice",
        ),
        (_chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
        (_chat(response_format={"type": "json_object"}, guided_regex="a+"), "guided_regex"),
        (_chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
        (_chat(guided_choice=[]), "guided_choice"),
        (
            _chat(stream_options={"include_usage": True, "continuous_usage_stats": True}),
            "stream_options.continuous_usage_stats",
        ),
        (_chat(temprature=0.5), "temprature"),  # a misspelt field is refused, not ignored
        ({"model": "fake", "messages": [{"role": "user", "content": "x", "name": "refused"}]}, "messages"),
        (_chat(cache_salt=""), "cache_salt"),
        (_chat(cache_salt=7), "cache_salt"),
        (_chat(cache_salt="x" * 257), "cache_salt"),
    ],
)
def test_bad_chat_requests_get_openai_400(served: Served, body: dict[str, object], param: str) -> None:
    response = _post(served, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


@pytest.mark.parametrize("cache_salt", ["", ["a"], "x" * 257])
def test_bad_cache_salt_on_completions_is_400(served: Served, cache_salt: object) -> None:
    response = _post(served, "/v1/completions", {"model": "fake", "prompt": "hi", "cache_salt": cache_salt})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cache_salt"
    assert not served.engine.submitted


def test_cache_salt_reaches_the_engine(client: openai.OpenAI, served: Served) -> None:
    client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        n=2,
        extra_body={"cache_salt": "tenant-a"},
    )
    client.completions.create(
        model="fake", prompt=["a", "b"], max_tokens=1, extra_body={"cache_salt": "x" * 256}
    )
    client.completions.create(model="fake", prompt="a", max_tokens=1)
    salts = [request.cache_salt for request in served.engine.submitted]
    assert salts == ["tenant-a", "tenant-a", "x" * 256, "x" * 256, None]


def test_prompt_longer_than_the_context_is_400(served: Served) -> None:
    response = _post(served, "/v1/completions", {"model": "fake", "prompt": "x" * 300})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"


def test_unknown_model_is_404(served: Served, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert raised.value.status_code == 404
    error = _post(served, "/v1/completions", {"model": "nope", "prompt": "x"}).json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")


def test_bad_request_through_the_client_raises_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], temperature=-1
        )
    assert "temperature" in str(raised.value)


def test_malformed_json_is_400(served: Served) -> None:
    response = httpx.post(
        f"{served.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_engine_failure_is_500_without_internals(served: Served) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("secret internal detail")

    served.engine.submit = broken  # type: ignore[method-assign]
    response = _post(served, "/v1/chat/completions", _chat())
    assert response.status_code == 500
    assert "secret" not in response.text
    assert response.json()["error"]["type"] == "internal_server_error"


def test_health_metrics_docs(served: Served, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    _post(served, "/v1/chat/completions", _chat(temperature=-1))
    assert httpx.get(f"{served.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{served.base_url}/docs").status_code == 200
    text = httpx.get(f"{served.base_url}/metrics").text
    assert 'strata_requests_total{model="fake",status="success"} 1.0' in text
    assert 'strata_requests_total{model="fake",status="invalid"} 1.0' in text
    assert 'strata_generation_tokens_total{model="fake"} 2.0' in text
    assert 'strata_time_to_first_token_seconds_count{model="fake"} 1.0' in text
    assert 'strata_inter_token_latency_seconds_count{model="fake"} 1.0' in text
    assert 'strata_requests_in_flight{model="fake"} 0.0' in text
    assert 'strata_requests_queued{model="fake"} 0.0' in text
    assert 'strata_kv_cache_hit_rate{model="fake"}' in text


def test_client_disconnect_aborts_the_stream(served: Served) -> None:
    served.engine.step_s = 0.02
    with httpx.stream(
        "POST", f"{served.base_url}/v1/chat/completions", timeout=10, json=_chat(max_tokens=200, stream=True)
    ) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    request_id = served.engine.submitted[0].request_id
    wait_for(lambda: request_id in served.engine.aborted, 10, 0.005, what="the abort")
    assert len(served.engine.aborted) == 1


def test_client_disconnect_aborts_a_non_streaming_request(served: Served) -> None:
    served.engine.step_s = 0.02
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.base_url}/v1/chat/completions", json=_chat(max_tokens=200), timeout=0.3)
    wait_for(
        lambda: served.engine.aborted == [served.engine.submitted[0].request_id], 10, 0.005, what="the abort"
    )


def test_finished_requests_are_not_aborted(client: openai.OpenAI, served: Served) -> None:
    list(
        client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
    )
    client.completions.create(model="fake", prompt="x", max_tokens=2, n=2)
    assert served.engine.aborted == []


def test_disconnect_during_a_slow_submit_leaves_no_request_running(served: Served) -> None:
    served.engine.step_s = 0.02
    served.engine.submit_s = 0.15
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.base_url}/v1/chat/completions", json=_chat(max_tokens=200, n=4), timeout=0.2)
    wait_for(
        lambda: len(served.engine.submitted) >= 1 and not _running(served),
        10,
        0.005,
        what="the request ended",
    )
    assert len(served.engine.submitted) < 4  # submission stopped once the client was gone


def _running(served: Served) -> list[str]:
    return [r.request_id for r in served.engine.submitted if r.request_id not in served.engine.aborted]


def test_full_wait_queue_is_429_with_retry_after(served: Served, client: openai.OpenAI) -> None:
    """n=2 whose second engine request is refused: 429 in OpenAI's shape, and the first one is aborted."""
    real_submit = served.engine.submit

    def refuse_second(request, sink) -> None:
        if request.request_id.endswith("-1"):
            raise EngineOverloaded("5 requests are waiting (max_queued_requests)", retry_after_s=2.5)
        real_submit(request, sink)

    served.engine.submit = refuse_second  # type: ignore[method-assign]
    response = _post(served, "/v1/chat/completions", {**_chat(), "n": 2, "max_tokens": 50})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "3"
    error = response.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and error["code"] == "queue_full"
    assert "max_queued_requests" in error["message"]
    wait_for(lambda: len(served.engine.aborted) == 1, 10, 0.005, what="the abort")
    assert served.engine.aborted[0].endswith("-0")
    assert served.metrics.requests.labels("fake", "rejected")._value.get() == 1
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="fake", prompt="hi", n=2, max_tokens=2)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_engine_failed_gets_500_with_the_reason(served: Served, stream: bool) -> None:
    def failing(request, sink) -> None:
        sink(
            GenerationOutput(
                request.request_id, [], "", True, "error", 3, 0, 0, "internal engine error: ValueError: x"
            )
        )

    served.engine.submit = failing  # type: ignore[method-assign]
    response = _post(served, "/v1/chat/completions", {**_chat(), "stream": stream})
    if stream:
        assert response.status_code == 200
        assert "internal engine error: ValueError: x" in response.text
    else:
        assert response.status_code == 500
        assert response.json()["error"]["message"] == "internal engine error: ValueError: x"


def test_priority_reaches_the_engine_request(served) -> None:
    """vLLM's `priority` (lower first) travels with the engine request; the engine decides (fcfs engines refuse
    anything but 0: tests/engine/test_priority.py)."""
    import openai

    api = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0)
    api.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=1, extra_body={"priority": -3}
    )
    assert served.engine.submitted[-1].priority == -3
