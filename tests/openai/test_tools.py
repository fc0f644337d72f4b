"""Tool calling's pieces without a model: the default tool prompt, the grammar of a forced call, the hermes parser
and the streamed deltas (tests/openai/test_openai_smollm2.py drives them end to end)."""

from __future__ import annotations

import json

import httpx
import jsonschema

from server.engine import chat
from server.engine.api import chat_turns, turn_dicts
from server.openai import tools
from server.openai.chat_core import ChatCompletionRequest
from server.openai.tools import FunctionDef, Tool

WEATHER = Tool(
    type="function",
    function=FunctionDef(
        name="get_weather",
        description="Current weather of a city",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    ),
)


def request(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    return ChatCompletionRequest.model_validate({**body, **fields}, strict=False)


TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
]
TOOLS = [WEATHER.model_dump(mode="json", exclude_none=True)]


def test_the_default_tool_prompt_and_tool_turns() -> None:
    rendered = chat.default_tool_turns(TURNS, TOOLS)
    assert rendered[0]["role"] == "system" and rendered[0]["content"].startswith(
        "Be brief.\n\nYou are a function"
    )
    assert '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    }
    assert rendered[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    assert chat.default_tool_turns(TURNS[1:2], None) == [{"role": "user", "content": "Weather in Paris?"}]


class Template:
    """A tokenizer's chat-template side: what it was asked to render."""

    def __init__(self, chat_template: str) -> None:
        self.chat_template = chat_template
        self.calls: list[tuple[list, dict]] = []

    def apply_chat_template(self, turns, **kwargs) -> str:
        self.calls.append((turns, kwargs))
        return "rendered"


def test_a_template_that_knows_tools_gets_them_and_the_turns_as_they_are() -> None:
    own = Template(
        "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    chat.render(own, TURNS, TOOLS, None)
    turns, kwargs = own.calls[-1]
    assert kwargs["tools"] == TOOLS and turns[3]["role"] == "tool"
    assert turns[2]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"
    }  # an object, for the template
    plain = Template("{% for m in messages %}{{ m.content }}{% endfor %}")
    chat.render(plain, TURNS, TOOLS, None)
    turns, kwargs = plain.calls[-1]
    assert "tools" not in kwargs and turns[0]["content"].startswith("Be brief.\n\nYou are a function")


def test_the_frontend_gives_the_engine_the_turns_and_the_tools(served, fake_engine) -> None:
    body = {"model": "fake", "messages": TURNS, "tools": TOOLS, "tool_choice": "required", "max_tokens": 2}
    assert httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=10).status_code == 200
    turns, tools = fake_engine.chat_calls[-1]
    assert tools == TOOLS and turns[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert turns[3] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "c1"}
    none = {**body, "tool_choice": "none"}
    assert httpx.post(f"{served.base_url}/v1/chat/completions", json=none, timeout=10).status_code == 200
    assert fake_engine.chat_calls[-1][1] is None  # tool_choice none: the tools are not shown to the model


def test_the_grammar_of_required_and_named_calls() -> None:
    required = tools.grammar(request(tool_choice="required"), "required")
    schema = json.loads(required.spec)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    single = json.loads(
        tools.grammar(request(tool_choice="required", parallel_tool_calls=False), "required").spec
    )
    assert single["maxItems"] == 1
    named = tools.grammar(
        request(tool_choice={"type": "function", "function": {"name": "get_weather"}}), "get_weather"
    )
    assert json.loads(named.spec) == WEATHER.function.parameters
    assert tools.grammar(request(), "auto") is None


def test_hermes_parser_finds_calls_and_keeps_the_rest() -> None:
    parser = tools.HermesParser()
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parser.parse(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert parser.parse("No tools needed.") == ("No tools needed.", [])
    assert parser.parse("<tool_call>not json</tool_call>")[1] == []


def test_streamed_auto_holds_back_a_tag_and_sends_the_calls_at_the_end() -> None:
    stream = tools.StreamedCalls("auto", tools.HermesParser())
    pieces = [
        "Sure",
        ". <tool",
        '_call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Rome"}}\n</tool_call>',
    ]
    sent = [stream.feed(piece, finished=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    assert "".join(text for text, _ in sent) == "Sure. "
    deltas = [d for _, ds in sent for d in ds]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert json.loads(deltas[1].function.arguments) == {"city": "Rome"} and stream.made_calls


def test_streamed_named_call_sends_its_arguments_as_they_come() -> None:
    stream = tools.StreamedCalls("get_weather", None)
    first = stream.feed('{"city": ', finished=False)[1]
    second = stream.feed('"Oslo"}', finished=True)[1]
    assert first[0].function.name == "get_weather" and first[1].function.arguments == '{"city": '
    assert second[0].function.arguments == '"Oslo"}' and second[0].id is None
    assert [(c.name, c.arguments) for c in stream.calls] == [("get_weather", '{"city": "Oslo"}')]


def test_turns_cross_a_worker_link_unchanged() -> None:
    assert turn_dicts(chat_turns(TURNS)) == TURNS
