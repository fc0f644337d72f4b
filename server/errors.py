"""`ConfigError`: the one error type for configuration an operator wrote (config.pbtxt, model.json, overrides)."""

from __future__ import annotations

from pathlib import Path


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
