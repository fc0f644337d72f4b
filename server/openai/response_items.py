"""The output side of the Responses API: output items, the response object, and the events of a streamed response.

A chat answer becomes output items: its text one `message` item (one `output_text` part), each tool call one
`function_call` item. Streamed, the same items are built from the chat deltas (chat.ChatChunks) and announced with
OpenAI's documented sequence: response.created, response.in_progress, then per item output_item.added,
(content_part.added, output_text.delta..., output_text.done, content_part.done | function_call_arguments.delta...,
function_call_arguments.done), output_item.done, and last response.completed (response.incomplete when the answer
was cut at max_output_tokens). Every event carries `sequence_number`; ids stay the same from `added` to the final
response, as the official client checks.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from server.openai.chat_core import ChatChoice, DeltaMessage
from server.openai.protocol import Usage

Item = dict[str, Any]


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> Item:
    return {
        "type": "message",
        "id": item_id or f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [output_text(text)],
    }


def output_text(text: str) -> Item:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> Item:
    return {
        "type": "function_call",
        "id": f"fc_{call_id.removeprefix('call_')}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def items_of(choice: ChatChoice) -> list[Item]:
    """The output items of a whole chat answer: its text (if any), then its tool calls."""
    items = [message_item(choice.message.content)] if choice.message.content else []
    for call in choice.message.tool_calls or ():
        items.append(function_call_item(call.id, call.function.name, call.function.arguments))
    return items


def assistant_turn(items: list[Item]) -> dict[str, Any]:
    """The output items as the chat turn the next turn's prompt renders (a conversation is chat turns)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in items
        if i["type"] == "function_call"
    ]
    if calls:
        turn["tool_calls"] = calls
    return turn


def response_usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def finish(response: dict[str, Any], items: list[Item], finish_reason: str | None, usage: Usage) -> None:
    """Fill in a response's outcome: its items, status (incomplete when cut at max_output_tokens), usage."""
    response["output"] = items
    response["usage"] = response_usage(usage)
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"
    response["completed_at"] = int(time.time())


class ResponseEvents:
    """The events of one streamed response, built from its chat deltas; `items` is the output so far."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.items: list[Item] = []
        self._sequence = 0
        self._open: Item | None = None  # the item receiving deltas
        self._calls: dict[int, Item] = {}  # the chat delta's tool call index -> its item

    def event(self, type_: str, **fields: Any) -> str:
        """One server-sent event: `event: <type>` and its JSON with the next sequence number."""
        body = {"type": type_, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {type_}\ndata: {json.dumps(body)}\n\n"

    def start(self) -> list[str]:
        snapshot = {**self.response, "status": "in_progress", "output": []}
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def delta(self, delta: DeltaMessage) -> list[str]:
        events: list[str] = []
        if delta.content:
            if self._open is None or self._open["type"] != "message":
                events += self._close()
                events += self._add(message_item("", status="in_progress"))
                events.append(self._part_event("response.content_part.added", output_text("")))
            item = self._open
            assert item is not None
            item["content"][0]["text"] += delta.content
            events.append(self._text_event("response.output_text.delta", delta=delta.content))
        for call in delta.tool_calls or ():
            item = self._calls.get(call.index)
            if item is None:
                events += self._close()
                item = function_call_item(call.id or "", call.function.name or "", "", status="in_progress")
                self._calls[call.index] = item
                events += self._add(item)
            if call.function.arguments:
                item["arguments"] += call.function.arguments
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self.items.index(item),
                        delta=call.function.arguments,
                    )
                )
        return events

    def end(self, finish_reason: str | None, usage: Usage) -> list[str]:
        """Close the open item and send the final response (completed, or incomplete when cut short)."""
        events = self._close()
        finish(self.response, self.items, finish_reason, usage)
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        return events + [self.event(kind, response=self.response)]

    def _add(self, item: Item) -> list[str]:
        self.items.append(item)
        self._open = item
        added = {**item, "content": []} if item["type"] == "message" else dict(item)
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=added)]

    def _close(self) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events = [
                self._text_event("response.output_text.done", text=text, item=item),
                self._part_event("response.content_part.done", item["content"][0], item=item),
            ]
        else:
            events = [
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        item["status"] = "completed"
        return events + [self.event("response.output_item.done", output_index=index, item=item)]

    def _text_event(self, type_: str, item: Item | None = None, **fields: Any) -> str:
        item = item or self._open
        assert item is not None
        index = self.items.index(item)
        return self.event(
            type_, item_id=item["id"], output_index=index, content_index=0, logprobs=[], **fields
        )

    def _part_event(self, type_: str, part: Item, item: Item | None = None) -> str:
        item = item or self._open
        assert item is not None
        return self.event(
            type_, item_id=item["id"], output_index=self.items.index(item), content_index=0, part=dict(part)
        )
