"""docs/openai.md's field table names every request field the code knows, and nothing else: the declared (honored) fields
of the request models and the refused list of server/openai/fields.py."""

from __future__ import annotations

import re
from pathlib import Path

from server.openai.chat_core import ChatCompletionRequest
from server.openai.completions import CompletionRequest
from server.openai.fields import REFUSED, RESPONSES_REFUSED
from server.openai.response_request import ResponsesRequest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "openai.md"


def table_fields(header: str = "| Field | Endpoint | Strata |") -> set[str]:
    text = PAGE.read_text()
    start = text.index(header)
    rows = text[start:].split("\n\n", 1)[0].splitlines()[2:]
    return {name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}


def test_the_readme_table_lists_exactly_the_fields_the_code_knows() -> None:
    declared = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    known = declared | REFUSED
    listed = table_fields()
    assert listed - known == set(), "in the page's table, unknown to the code"
    assert known - listed == set(), "known to the code, missing from the page's table"


def test_the_responses_table_lists_exactly_the_fields_the_code_knows() -> None:
    known = set(ResponsesRequest.model_fields) | RESPONSES_REFUSED
    listed = table_fields("| Responses field | Strata |")
    assert listed - known == set(), "in the page's Responses table, unknown to the code"
    assert known - listed == set(), "known to the code, missing from the page's Responses table"
