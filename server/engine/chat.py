"""Chat turns to prompt text: the model's chat template (or model.json's `chat_template`), with tools.

Turns are OpenAI's messages as dicts: {"role", "content"[, "name"]}, an assistant turn's "tool_calls"
([{"id", "type": "function", "function": {"name", "arguments": JSON text}}]) and a tool turn's "tool_call_id".
A template that knows tools (its source uses `tools`, as Qwen's, Llama 3.1's, Hermes' do) gets them and the turns as
they are, with each call's arguments as an object (what such templates index into); any other template gets the
default tool prompt (Hermes' format): the tools described in a system message, earlier calls as `<tool_call>` lines
of the assistant's content, tool turns as user turns holding `<tool_response>`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

TOOL_PROMPT = """You are a function calling AI model. You are provided with function signatures within <tools></tools> \
XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about what \
values to plug into functions. Here are the available tools: <tools>{tools}</tools>
For each function call return a json object with function name and arguments within <tool_call></tool_call> XML \
tags as follows:
<tool_call>
{{"name": <function-name>, "arguments": <args-dict>}}
</tool_call>"""


def knows_tools(template: str | None) -> bool:
    """Does this chat template render tools itself?"""
    return template is not None and "tools" in template


def render(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template: str | None,
) -> str:
    """The prompt text of `messages` (ending with the assistant's turn) through `tokenizer`'s chat template, or
    `chat_template` instead; `tokenizer` is a transformers tokenizer."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # a tokenizer with named templates: the default one
        template = template.get("default")
    if knows_tools(template):
        turns: list[dict[str, Any]] = [_with_argument_objects(m) for m in messages]
        extra = {"tools": list(tools)} if tools else {}
    else:
        turns, extra = default_tool_turns(messages, tools), {}
    return tokenizer.apply_chat_template(
        turns, add_generation_prompt=True, tokenize=False, chat_template=chat_template, **extra
    )


def _with_argument_objects(message: Mapping[str, Any]) -> dict[str, Any]:
    turn = dict(message)
    if turn.get("tool_calls"):
        turn["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": _loads(call["function"]["arguments"])}}
            for call in turn["tool_calls"]
        ]
    return turn


def default_tool_turns(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, str]]:
    """The turns as plain {"role", "content"[, "name"]} for a template without tools: the default tool prompt."""
    out: list[dict[str, str]] = []
    for message in messages:
        content = message.get("content") or ""
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n"
                + json.dumps({"name": c["function"]["name"], "arguments": _loads(c["function"]["arguments"])})
                + "\n</tool_call>"
                for c in message["tool_calls"]
            )
            content = f"{content}\n{calls}" if content else calls
        if message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
            continue
        name = {"name": message["name"]} if message.get("name") else {}
        out.append({"role": message["role"], "content": content, **name})
    if tools:
        prompt = TOOL_PROMPT.format(tools="\n".join(json.dumps(tool) for tool in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _loads(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # rendered as the string the client sent
