"""The engine's logprobs (`TokenLogprobs`) in the OpenAI API's shapes: chat's `logprobs.content`, completions'
legacy `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`, and vLLM's `prompt_logprobs`.

JSON has no -inf: a logprob below -9999 is sent as -9999.0, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, Field

from server.engine.api import TokenLogprobs
from server.openai.sampling import SamplingFields

FLOOR = -9999.0


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: one entry per token of `text`; the first prompt token's logprob and alternatives
    are null; `text_offset` is each token's start in `text`, in characters."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`: {token id: this}; the prompt token itself and its top alternatives."""

    logprob: float
    rank: int | None = None  # 1 is the most likely; null for the prompt token when it is not among the top
    decoded_token: str


def _value(logprob: float) -> float:
    return logprob if logprob > FLOOR else FLOOR


def chat(entries: Iterable[TokenLogprobs]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=e.token,
                logprob=_value(e.logprob),
                bytes=list(e.token.encode()),
                top_logprobs=[
                    TopLogprob(token=text, logprob=_value(value), bytes=list(text.encode()))
                    for text, value in zip(e.top_tokens, e.top_logprobs, strict=True)
                ],
            )
            for e in entries
        ]
    )


class LogprobPieces:
    """Builds one choice's legacy logprobs piece by piece (a stream's chunks each carry their tokens' part);
    `text_offset` counts characters from the start of the choice's text, token texts laid end to end."""

    def __init__(self) -> None:
        self.offset = 0

    def piece(self, entries: Iterable[tuple[str, TokenLogprobs | None]]) -> CompletionLogprobs:
        """`entries`: (token text, its logprobs; None for a prompt's first token, which has none)."""
        out = CompletionLogprobs()
        for text, entry in entries:
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(text)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_value(entry.logprob))
            top = {t: _value(v) for t, v in zip(entry.top_tokens, entry.top_logprobs, strict=True)}
            top.setdefault(entry.token, _value(entry.logprob))  # the chosen token too, as vLLM's
            out.top_logprobs.append(top)
        return out


def generated(entries: Iterable[TokenLogprobs]) -> list[tuple[str, TokenLogprobs | None]]:
    return [(e.token, e) for e in entries]


def echoed(first_token: str, prompt: list[TokenLogprobs | None]) -> list[tuple[str, TokenLogprobs | None]]:
    """The prompt's tokens with their logprobs (`prompt` from the engine: entry 0 None), the first named by
    `first_token` (its text on its own)."""
    return [(first_token, None), *((e.token, e) for e in prompt[1:] if e is not None)]


def vllm_prompt(prompt: list[TokenLogprobs | None]) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: logprob, rank, decoded_token} for the token itself and
    its top alternatives (ranks 1..k); None for the first token."""
    out: list[dict[str, PromptLogprob] | None] = []
    for entry in prompt:
        if entry is None:
            out.append(None)
            continue
        ranked = {
            str(tid): PromptLogprob(logprob=_value(value), rank=rank, decoded_token=text)
            for rank, (tid, value, text) in enumerate(
                zip(entry.top_token_ids, entry.top_logprobs, entry.top_tokens, strict=True), start=1
            )
        }
        ranked.setdefault(
            str(entry.token_id), PromptLogprob(logprob=_value(entry.logprob), decoded_token=entry.token)
        )
        out.append(ranked)
    return out


def prompt_logprobs(
    request: SamplingFields, prompt: list[TokenLogprobs | None] | None
) -> list[dict[str, PromptLogprob] | None] | None:
    """A choice's vLLM `prompt_logprobs`: None unless the request asked for them and the engine sent them."""
    if request.prompt_logprobs is None or prompt is None:
        return None
    return vllm_prompt(prompt)
