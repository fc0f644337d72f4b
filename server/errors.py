"""`ConfigError`: the one error type for configuration an operator wrote (config.pbtxt, model.json, overrides)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
