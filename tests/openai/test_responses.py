"""POST /v1/responses, GET and DELETE /v1/responses/{id}, through the official openai client, over the fake engine
(tests/openai/conftest.py: answer token i is " t{i}", every answer runs to max_tokens, its chat template renders
`<role>content` per turn then `<assistant>`); SmolLM2's tools and json_schema are in test_openai_smollm2.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from conftest import FakeEngine, Served, serve_app
from prometheus_client import CollectorRegistry

from server.openai.app import build_app
from server.openai.metrics import FrontendMetrics
from server.openai.response_store import MemoryResponseStore, RedisResponseStore


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_a_response_and_a_conversation_continued_by_its_id(served: Served) -> None:
    api = client(served.base_url)
    first = api.responses.create(
        model="fake", input="hi", instructions="be brief", max_output_tokens=3, metadata={"k": "v"}
    )
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.output_text == " t0 t1 t2"
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.input_tokens == len("<system>be brief<user>hi<assistant>")
    assert first.usage.output_tokens == 3 and first.usage.input_tokens_details.cached_tokens == 4
    assert first.metadata == {"k": "v"} and first.instructions == "be brief"
    second = api.responses.create(
        model="fake",
        input="more",
        instructions="be brief",
        previous_response_id=first.id,
        max_output_tokens=2,
    )
    turns, _ = served.engine.chat_calls[-1]
    assert [(t["role"], t["content"]) for t in turns] == [
        ("system", "be brief"),
        ("user", "hi"),
        ("assistant", " t0 t1 t2"),
        ("user", "more"),
    ]
    prompts = [r.prompt_token_ids for r in served.engine.submitted]
    answered = prompts[0] + list(served.engine.encode(" t0 t1 t2"))
    assert prompts[1][: len(answered)] == answered  # turn 2's prompt extends turn 1's prompt and answer
    assert second.previous_response_id == first.id
    assert api.responses.retrieve(first.id).output_text == " t0 t1 t2"
    assert api.responses.delete(first.id) is None  # the client returns nothing for 200
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as raised:
        api.responses.create(model="fake", input="x", previous_response_id=first.id)
    assert raised.value.body["param"] == "previous_response_id"


def test_input_items_become_chat_turns(served: Served) -> None:
    """Messages with typed parts, a function call and its output: one assistant turn with the call, one tool turn."""
    api = client(served.base_url)
    api.responses.create(
        model="fake",
        input=[
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "P"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        max_output_tokens=1,
        store=False,
    )
    turns, _ = served.engine.chat_calls[-1]
    assert turns[:2] == [{"role": "developer", "content": "rules"}, {"role": "user", "content": "weather?"}]
    assert turns[2]["role"] == "assistant" and turns[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert turns[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_store_false_keeps_nothing(served: Served) -> None:
    api = client(served.base_url)
    reply = api.responses.create(model="fake", input="hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(reply.id)


@pytest.mark.parametrize(
    ("field", "value"),
    [("reasoning", {"effort": "high"}), ("background", True), ("truncation", "auto"), ("nonsense", 1)],
)
def test_a_field_strata_does_not_do_is_refused_by_name(served: Served, field: str, value: object) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client(served.base_url).responses.create(
            model="fake", input="hi", max_output_tokens=1, extra_body={field: value}
        )
    assert raised.value.body["param"] == field


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content",
        ),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_fields_are_named_as_the_responses_api_names_them(served: Served, body: dict, param: str) -> None:
    reply = httpx.post(
        f"{served.base_url}/v1/responses",
        json={"model": "fake", "input": "hi", "max_output_tokens": 2, **body},
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].startswith(param), reply.json()


def test_a_streamed_response_sends_the_documented_events_in_order(served: Served) -> None:
    api = client(served.base_url)
    with api.responses.stream(model="fake", input="hi", max_output_tokens=3) as stream:
        events = [event.type for event in stream]
    assert events == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # cut at max_output_tokens, as every fake answer is
    ]
    raw = httpx.post(
        f"{served.base_url}/v1/responses",
        json={"model": "fake", "input": "hi", "max_output_tokens": 2, "stream": True},
    ).text
    datas = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    final = datas[-1]["response"]
    stored = api.responses.retrieve(final["id"])  # stored before the last event was sent
    assert stored.output_text == " t0 t1" and stored.output[0].id == datas[2]["item"]["id"]


def test_previous_response_id_works_through_any_frontend_sharing_redis(redis_url: str) -> None:
    """Two frontends (two replicas) over one Redis: a conversation started on one continues on the other; each
    frontend's own memory store would not know the id."""
    engine = FakeEngine()

    def frontend(store):
        return serve_app(
            build_app({"fake": engine}, FrontendMetrics.create(CollectorRegistry()), response_store=store)
        )

    with (
        frontend(RedisResponseStore(redis_url, ttl_s=60, max_entries=100)) as a,
        frontend(RedisResponseStore(redis_url, ttl_s=60, max_entries=100)) as b,
        frontend(MemoryResponseStore(ttl_s=60, max_entries=100)) as alone,
    ):
        first = client(a).responses.create(model="fake", input="hi", max_output_tokens=2)
        second = client(b).responses.create(
            model="fake", input="more", previous_response_id=first.id, max_output_tokens=2
        )
        turns, _ = engine.chat_calls[-1]
        assert [t["content"] for t in turns] == ["hi", " t0 t1", "more"]
        assert client(a).responses.retrieve(second.id).output_text == " t0 t1"
        with pytest.raises(openai.BadRequestError):
            client(alone).responses.create(model="fake", input="x", previous_response_id=first.id)


@pytest.mark.parametrize("make", ["memory", "redis"])
def test_a_store_bounds_its_entries_and_their_age(make: str, request: pytest.FixtureRequest) -> None:
    if make == "redis":
        store = RedisResponseStore(request.getfixturevalue("redis_url"), ttl_s=0.2, max_entries=3)
    else:
        store = MemoryResponseStore(ttl_s=0.2, max_entries=3)

    async def check() -> None:
        for i in range(5):
            await store.put(f"r{i}", {"response": {"id": f"r{i}"}, "turns": []})
        assert [await store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
        assert await store.delete("r4") and not await store.delete("r4")
        await store.put("late", {"response": {}, "turns": []})
        await asyncio.sleep(0.3)  # the behaviour under test: an entry older than its TTL is gone
        assert await store.get("late") is None and await store.get("r3") is None
        await store.close()

    asyncio.run(check())


def test_input_items_lists_the_request_items_in_pages(served: Served) -> None:
    api = client(served.base_url)
    reply = api.responses.create(
        model="fake",
        input=[
            {"role": "user", "content": "What is the weather?"},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        max_output_tokens=1,
    )
    items = api.responses.input_items.list(reply.id, order="asc")
    assert [item.type for item in items.data] == ["message", "function_call", "function_call_output"]
    assert items.data[0].content[0].text == "What is the weather?" and items.data[2].output == "sunny"
    assert items.first_id == items.data[0].id and items.last_id == items.data[2].id and not items.has_more
    newest = api.responses.input_items.list(reply.id, limit=2)  # desc by default
    assert [item.type for item in newest.data] == [
        "function_call_output",
        "function_call",
    ] and newest.has_more
    rest = api.responses.input_items.list(reply.id, limit=2, after=newest.last_id)
    assert [item.type for item in rest.data] == ["message"] and not rest.has_more
    single = api.responses.create(model="fake", input="hi", max_output_tokens=1)
    (message,) = api.responses.input_items.list(single.id).data
    assert message.role == "user" and message.content[0].type == "input_text"
    with pytest.raises(openai.NotFoundError):
        api.responses.input_items.list("resp_nope")
    with pytest.raises(openai.BadRequestError) as raised:
        api.responses.input_items.list(reply.id, after="nope")
    assert raised.value.body["param"] == "after"
