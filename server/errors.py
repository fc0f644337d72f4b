"""`ConfigError`: the one error type for configuration an operator wrote (config.pbtxt, model.json, overrides), and
how a msgspec validation error of a config Struct becomes one (`config_error`, `field_problem`)."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(ge=1, description="a positive integer")]


class ConfigError(ValueError):
    """A configuration that cannot be used, with the place to fix it: `where` is a file (or a label such as
    "smollm2 (model.json with command-line overrides)"), then the line and column when known."""

    def __init__(
        self, where: str | Path, message: str, line: int | None = None, column: int | None = None
    ) -> None:
        self.where = where
        self.message = message
        self.line = line
        self.column = column
        super().__init__(str(self))

    def __str__(self) -> str:
        place = str(self.where)
        if self.line is not None:
            place += f":{self.line}" + (f":{self.column}" if self.column is not None else "")
        return f"{place}: {self.message}"


def read_json(path: Path) -> Any:
    """The JSON in `path`; ConfigError with the line and column of a syntax error, or why it cannot be read."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(path, f"invalid JSON: {err.msg}", err.lineno, err.colno) from err
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(path, f"cannot read: {getattr(err, 'strerror', None) or err}") from err


def config_error(where: str | Path, exc: msgspec.ValidationError, schema: type, values: Any) -> ConfigError:
    """The ConfigError of a msgspec validation error in `values` (JSON values) checked against the Struct `schema`:
    "<where>: <field>: <problem>"."""
    field, problem = field_problem(exc, schema, values)
    return ConfigError(where, f"{field}: {problem}" if field else problem)


_AT = re.compile(r"(?P<problem>.*?)(?: - at `\$(?P<path>[^`]*)`)?", re.S)
_FIELD = re.compile(r"Object (?P<kind>contains unknown|missing required) field `(?P<name>[^`]+)`")
_CONSTRAINT = re.compile(r"Expected `[^`]+` (?P<bound>[<>]=? .+|of length .+)")


def field_problem(exc: msgspec.ValidationError, schema: type, values: Any) -> tuple[str, str]:
    """The field a msgspec validation error names ("block_size", "prefill[0].ttft_s"; "" for the whole object)
    and what is wrong with it, in the words of this project's messages: "must be >= 1, got 0", "unknown key;
    allowed: ...", "missing (required)". A top-level field of `schema` whose Meta has a description (or whose
    type is a Literal) is described by it; the value comes from `values`."""
    match = _AT.fullmatch(str(exc))
    problem, path = match["problem"], (match["path"] or "").lstrip(".")
    if named := _FIELD.fullmatch(problem):
        field = f"{path}.{named['name']}" if path else named["name"]
        if named["kind"] == "missing required":
            allowed = None if path else _allowed(schema, named["name"])
            return field, "missing (required)" + (f", must be {allowed}" if allowed else "")
        if path:
            return field, "unknown key"
        return field, "unknown key; allowed: " + ", ".join(
            sorted(f.name for f in msgspec.structs.fields(schema))
        )
    if allowed := _allowed(schema, path):
        problem = f"must be {allowed}"
    elif constraint := _CONSTRAINT.fullmatch(problem):
        problem = f"must be {constraint['bound']}"
    else:
        problem = problem[:1].lower() + problem[1:]
    if isinstance(values, dict) and path in values and ", got " not in problem:
        problem += f", got {values[path]!r}"
    return path, problem


def _allowed(schema: type, field: str) -> str | None:
    """The allowed values of `schema`'s top-level `field` as its Meta's description or its Literal's choices."""
    info = next((f for f in msgspec.structs.fields(schema) if f.name == field), None)
    pending, choices = [info.type] if info is not None else [], []
    while pending:
        annotation = pending.pop()
        if isinstance(annotation, msgspec.Meta) and annotation.description:
            return annotation.description
        if typing.get_origin(annotation) is Literal:
            choices += typing.get_args(annotation)
        else:
            pending += typing.get_args(annotation)
    return f"one of {', '.join(map(str, choices))}" if choices else None
