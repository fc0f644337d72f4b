"""What a generation's engine requests produced, gathered per choice, and the usage they add up to.

A request with p prompts and `n` gets p x n choices: choice i is engine request i, of prompt i // n.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.engine.api import GenerationOutput, TokenLogprobs
from server.openai.errors import failed
from server.openai.generation import Generation
from server.openai.protocol import PromptTokensDetails, Usage
from server.openai.sampling import SamplingFields
from server.openai.served import ServedModels


@dataclass(slots=True)
class Choice:
    """What one engine request (one choice) has produced so far."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    started: bool = False
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def add(self, output: GenerationOutput) -> None:
        self.started = True
        self.text.append(output.new_text)
        if output.logprobs:
            self.logprobs.extend(output.logprobs)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.prompt_tokens = output.num_prompt_tokens or self.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        self.output_tokens = output.num_output_tokens or self.output_tokens
        if output.finished:
            self.finish_reason = output.finish_reason


def usage(choices: list[Choice], n: int, prompt_only: bool = False) -> Usage:
    """The prompt counts once per prompt (not per choice), as OpenAI does; cached tokens are the first choice's.
    `prompt_only`: echo with max_tokens 0, whose generated tokens are not returned (nor counted)."""
    firsts = choices[::n]
    prompt = sum(c.prompt_tokens for c in firsts)
    completion = 0 if prompt_only else sum(c.output_tokens for c in choices)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(c.cached_tokens for c in firsts)),
    )


def final_status(choices: list[Choice]) -> str:
    """The `status` label of a generation that ended without an error."""
    return "aborted" if any(c.finish_reason == "abort" for c in choices) else "success"


async def collect(
    served: ServedModels, request: SamplingFields, generation: Generation, num_choices: int
) -> list[Choice]:
    """Every choice whole (a response without `stream`); an engine error raises its OpenAIError."""
    choices = [Choice() for _ in range(num_choices)]
    status = "aborted"
    try:
        async for index, output in generation.outputs():
            choices[index].add(output)
            if output.finish_reason == "error":
                status = "error"
                raise failed(output)
        status = final_status(choices)
        return choices
    finally:
        generation.close()
        served.count(request.model, status)
