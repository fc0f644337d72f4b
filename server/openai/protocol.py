"""Wire models every route shares: the strict request base, chat messages, usage, and how a response is dumped.

Each route module declares its own request and response models on these (chat.py, completions.py, tokenize.py,
models.py, disagg.py); the sampling fields of chat and completions are in sampling.py, the logprobs' shapes in
logprobs.py, the tools' in tools.py, the error body in errors.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError


class StrictRequest(BaseModel):
    """Strict: a string where a number belongs is a 400 naming the field, not a silent coercion. Text must be valid
    Unicode: JSON can escape a lone surrogate (`"\\ud800"`), which no tokenizer or UTF-8 encoder takes."""

    model_config = ConfigDict(extra="allow", strict=True)

    @field_validator("*")
    @classmethod
    def _no_lone_surrogates(cls, value: Any) -> Any:
        if not _encodable(value):
            raise PydanticCustomError(
                "unicode", "must be valid Unicode text (a lone surrogate such as \\ud800 is not)"
            )
        return value


def _encodable(value: Any) -> bool:
    """Every string in `value` (str, or lists of them; models check their own fields) encodes as UTF-8."""
    if isinstance(value, str):
        if value.isascii():
            return True
        try:
            value.encode()
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, list):
        return all(_encodable(item) for item in value)
    return True


class TextPart(StrictRequest):
    type: Literal["text"]
    text: str


class FunctionCallIn(StrictRequest):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCallIn(StrictRequest):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(StrictRequest):  # of /v1/chat/completions and of POST /tokenize with messages
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def turn(self) -> dict[str, Any]:
        """The message as the engine API's turn dict (what `Engine.apply_chat_template` renders)."""
        turn: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            turn["name"] = self.name
        if self.tool_calls:
            turn["tool_calls"] = [call.model_dump(mode="json") for call in self.tool_calls]
        if self.tool_call_id:
            turn["tool_call_id"] = self.tool_call_id
        return turn


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a response model (None fields kept: clients expect `logprobs: null`)."""
    return model.model_dump(mode="json")
