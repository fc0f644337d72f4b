"""Structured outputs in the engine (server/engine/structured.py): grammars as a bitmask in the sampler, on the real
SmolLM2 engine, sampled at temperature 1 so that only the mask keeps the output valid."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import collect_concurrently, greedy, run

from server.engine.api import (
    GenerationRequest,
    RequestError,
    RequestId,
    SamplingParams,
    continuation,
    structured_spec,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


def constrained(ids, request_id: str, kind: str, spec, max_tokens: int = 96, **fields) -> GenerationRequest:
    grammar = structured_spec("structured_outputs", kind, spec)
    params = SamplingParams(max_tokens=max_tokens, structured_outputs=grammar, **fields)
    return GenerationRequest(RequestId(request_id), list(ids), params)


@pytest.fixture(scope="module")
def ask_json(engine):
    return engine.apply_chat_template([{"role": "user", "content": "Describe a user of a web app as JSON."}])


def test_json_schema_output_validates_on_every_try_at_temperature_one(engine, ask_json):
    for seed in range(6):
        output = run(
            engine, constrained(ask_json, f"json-{seed}", "json", PERSON, temperature=1.0, seed=seed)
        )
        assert output.finish_reason == "stop", output.new_text
        jsonschema.validate(json.loads(output.new_text), PERSON)


def test_json_object_regex_choice_and_lark(engine, ask_json):
    output = run(
        engine, constrained(ask_json, "object", "json_object", None, max_tokens=200, temperature=0.0)
    )
    assert output.finish_reason == "stop" and isinstance(json.loads(output.new_text), dict)
    phone = r"\(0[1-9]\) [0-9]{3}-[0-9]{4}"
    output = run(engine, constrained(ask_json, "regex", "regex", phone, temperature=1.0, seed=2))
    assert re.fullmatch(phone, output.new_text) and output.finish_reason == "stop"
    choices = ["yes", "no", "not sure"]
    for seed in range(3):
        output = run(
            engine, constrained(ask_json, f"choice-{seed}", "choice", choices, temperature=1.0, seed=seed)
        )
        assert output.new_text in choices
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    output = run(engine, constrained(ask_json, "lark", "grammar", lark, temperature=1.0, seed=3))
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", output.new_text)


def test_a_bad_grammar_is_refused_at_submit_naming_its_field(engine, ask_json):
    for field, kind, spec in (
        ("guided_regex", "regex", "a(b"),
        ("response_format.json_schema.schema", "json", {"type": "nonsense"}),
        ("guided_grammar", "grammar", "start: ("),
    ):
        request = GenerationRequest(
            RequestId(f"bad-{kind}"),
            list(ask_json),
            SamplingParams(max_tokens=4, structured_outputs=structured_spec(field, kind, spec)),
        )
        with pytest.raises(RequestError) as raised:
            engine.submit(request, lambda output: None)
        assert raised.value.field == field


def test_a_continuation_resumes_the_grammar_where_it_stopped(engine, ask_json):
    """As after a migration: the first tokens came from elsewhere; the continuation replays them into the
    matcher and finishes the same (greedy) valid JSON."""
    request = constrained(ask_json, "whole", "json", PERSON, temperature=0.0)
    whole = run(engine, request)
    first = run(engine, constrained(ask_json, "first", "json", PERSON, max_tokens=7, temperature=0.0))
    rest = run(engine, continuation(request, first.new_token_ids))
    assert first.new_token_ids + rest.new_token_ids == whole.new_token_ids
    jsonschema.validate(json.loads(first.new_text + rest.new_text), PERSON)


def test_grammar_rows_leave_their_neighbours_unchanged(engine, prompt_ids, ask_json):
    plain = [greedy(prompt_ids[i], f"plain-{i}") for i in (0, 4)]
    alone = collect_concurrently(engine, plain)
    mixed = collect_concurrently(
        engine,
        [greedy(prompt_ids[i], f"plain-{i}") for i in (0, 4)]
        + [constrained(ask_json, "json-mixed", "json", PERSON, temperature=1.0, seed=9)],
    )
    assert {k: v for k, v in mixed.items() if k.startswith("plain")} == alone
    assert json.loads(engine.decode(mixed["json-mixed"]))


def test_a_schema_is_converted_once(engine, ask_json):
    grammars = engine.parts.grammars
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    run(engine, constrained(ask_json, "once-a", "json", schema, temperature=0.0))
    cached = dict(grammars._grammars)
    run(engine, constrained(ask_json, "once-b", "json", schema, temperature=0.0))
    assert dict(grammars._grammars) == cached
