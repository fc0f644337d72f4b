"""POST /v1/completions: its wire models and its serving.

A request holds one prompt or several (texts or token ids); each gets n choices, choice i of prompt i // n. With
`echo` each choice begins with its prompt (and, with `logprobs`, the prompt's logprobs); the logprobs are
OpenAI's legacy shape (logprobs.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from server.engine.api import GenerationOutput
from server.openai import logprobs as lp
from server.openai.choices import Choice, collect, usage
from server.openai.generation import WaitForDisconnect
from server.openai.limits import RequestLimits
from server.openai.protocol import Usage
from server.openai.sampling import SamplingFields
from server.openai.served import ServedModels
from server.openai.streaming import GENERATE_RESPONSES, client_gone, respond, stream


class CompletionRequest(SamplingFields):
    ENDPOINT: ClassVar[str] = "completions"
    PROMPT_FIELD: ClassVar[str] = "prompt"

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # 0..20: each token's logprob and that many alternatives (the legacy shape)
    echo: bool = False  # the prompt before the completion, in the text and, with logprobs, in the logprobs
    best_of: int | None = None  # accepted when equal to n (no choices are dropped)

    def max_tokens_generated(self) -> int | None:
        """With echo, max_tokens 0 asks for the prompt only: one token is generated and not returned."""
        asked = self.max_tokens_asked()
        return 1 if asked == 0 and self.echo else asked

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """`logprobs: k` alternatives per token; with `echo` the prompt's tokens get the same k."""
        prompt = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt = max(prompt or 0, self.logprobs)
        return self.logprobs, prompt

    def num_prompts(self) -> int:
        prompt = self.prompt
        if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
            return 1  # one text, or one list of token ids (an empty list is refused by serving)
        return len(prompt)

    def prompt_chars(self) -> list[int]:
        prompt = self.prompt
        return [
            len(text) for text in ([prompt] if isinstance(prompt, str) else prompt) if isinstance(text, str)
        ]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: lp.CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, lp.PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


@dataclass(slots=True)
class _Echo:
    """What `echo` puts before each prompt's choices: the prompt's text and its first token's text."""

    texts: list[str]
    first_tokens: list[str]
    prompt_only: bool  # max_tokens 0: the prompt and nothing generated


def router(served: ServedModels, limits: RequestLimits) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/completions", response_model=CompletionResponse, responses=GENERATE_RESPONSES)
    async def completion(body: CompletionRequest, request: Request) -> Response:
        served.check_limits(body, limits)
        return await respond(answer(served, body, lambda: client_gone(request)))

    return routes


async def answer(
    served: ServedModels, request: CompletionRequest, client_gone: WaitForDisconnect
) -> CompletionResponse | AsyncIterator[str]:
    engine = served.engine_for(request)
    texts = _prompt_list(request.prompt)
    if not texts:
        served.refuse(request.model, "the prompt list is empty", "prompt")

    echo = _Echo([], [], request.echo and request.max_tokens_asked() == 0) if request.echo else None
    if request.best_of is not None and request.best_of != request.n:
        served.refuse(request.model, "best_of: only best_of equal to n is supported", "best_of")

    def prompts() -> list[list[int]]:
        ids = [
            served.tokenize(request.model, "prompt", engine.encode, text) if isinstance(text, str) else text
            for text in texts
        ]
        if echo is not None:  # the prompt as the client sent it, or its ids decoded
            echo.texts = [t if isinstance(t, str) else served.decode(request.model, engine, t) for t in texts]
            echo.first_tokens = [served.decode(request.model, engine, i[:1]) for i in ids]
        return ids

    generation = await served.start(request, engine, prompts, client_gone)
    num_choices = len(texts) * request.n
    if request.stream:
        chunks = _CompletionChunks(request, generation.request_id, echo)
        return stream(served, request, generation, num_choices, chunks)
    choices = await collect(served, request, generation, num_choices)
    return CompletionResponse(
        id=f"cmpl-{generation.request_id}",
        model=request.model,
        usage=usage(choices, request.n, echo is not None and echo.prompt_only),
        choices=[_completion_choice(request, echo, i, c) for i, c in enumerate(choices)],
    )


class _CompletionChunks:
    """With echo, each choice's first chunk is its prompt (and the prompt's logprobs); then its completion's
    pieces, each with its tokens' logprobs (nothing of them when the prompt is all that was asked for)."""

    def __init__(self, request: CompletionRequest, request_id: str, echo: _Echo | None) -> None:
        self._id = f"cmpl-{request_id}"
        self._model = request.model
        self._created = int(time.time())
        self._n = request.n
        self._echo = echo
        self._logprobs = request.logprobs is not None
        self._offsets: dict[int, lp.LogprobPieces] = {}

    def for_output(self, index: int, output: GenerationOutput, first: bool) -> list[Any]:
        out = []
        offsets = self._offsets.setdefault(index, lp.LogprobPieces())
        echo = self._echo
        if first and echo is not None:
            prompt = index // self._n
            logprobs = None
            if self._logprobs and output.prompt_logprobs is not None:
                logprobs = offsets.piece(lp.echoed(echo.first_tokens[prompt], output.prompt_logprobs))
            out.append(
                self._response(CompletionChoice(index=index, text=echo.texts[prompt], logprobs=logprobs))
            )
        text, tokens = output.new_text, output.logprobs or []
        if echo is not None and echo.prompt_only:
            text, tokens = "", []
        logprobs = offsets.piece(lp.generated(tokens)) if self._logprobs and tokens else None
        if text or output.finished or logprobs is not None:
            choice = CompletionChoice(
                index=index, text=text, finish_reason=output.finish_reason, logprobs=logprobs
            )
            out.append(self._response(choice))
        return out

    def _response(self, choice: CompletionChoice) -> CompletionResponse:
        return CompletionResponse(id=self._id, created=self._created, model=self._model, choices=[choice])

    def usage(self, usage: Usage) -> CompletionResponse:
        return CompletionResponse(
            id=self._id, created=self._created, model=self._model, choices=[], usage=usage
        )


def _completion_choice(
    request: CompletionRequest, echo: _Echo | None, index: int, choice: Choice
) -> CompletionChoice:
    """One choice of a non-streaming completion: the prompt first with echo, the legacy logprobs with
    `logprobs`, vLLM's prompt_logprobs with `prompt_logprobs`."""
    generated = "" if echo is not None and echo.prompt_only else "".join(choice.text)
    tokens = [] if echo is not None and echo.prompt_only else choice.logprobs
    text, logprobs = generated, None
    if request.logprobs is not None:
        pieces = lp.generated(tokens)
        if echo is not None and choice.prompt_logprobs is not None:
            pieces = lp.echoed(echo.first_tokens[index // request.n], choice.prompt_logprobs) + pieces
        logprobs = lp.LogprobPieces().piece(pieces)
    if echo is not None:
        text = echo.texts[index // request.n] + generated
    return CompletionChoice(
        index=index,
        text=text,
        finish_reason=choice.finish_reason,
        logprobs=logprobs,
        prompt_logprobs=lp.prompt_logprobs(request, choice.prompt_logprobs),
    )


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]
