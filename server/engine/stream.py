"""Turn the engine's push-style sink into pull-style iterators (sync for threads, async for event loops).

Leaving the loop early (break, exception, task cancellation) aborts the request, so its blocks are freed.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator

from server.engine.api import Engine, GenerationOutput, GenerationRequest, TokenLogprobs


def iterate_outputs(
    engine: Engine, request: GenerationRequest, timeout: float | None = None
) -> Iterator[GenerationOutput]:
    """Submit and yield outputs until the finished one. `timeout`: seconds to wait for each output (None: forever);
    raises TimeoutError (after aborting) if it passes. RequestError is raised by the first `next()`."""
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    engine.submit(request, outputs.put)
    finished = False
    try:
        while not finished:
            try:
                output = outputs.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {request.request_id}: no output within {timeout} s") from None
            finished = output.finished
            yield output
    finally:
        if not finished:
            engine.abort(request.request_id)


async def aiterate_outputs(engine: Engine, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
    """Async version: the sink hands outputs to this event loop with call_soon_threadsafe."""
    loop = asyncio.get_running_loop()
    outputs: asyncio.Queue[GenerationOutput] = asyncio.Queue()
    engine.submit(request, lambda output: loop.call_soon_threadsafe(outputs.put_nowait, output))
    finished = False
    try:
        while not finished:
            output = await outputs.get()
            finished = output.finished
            yield output
    finally:
        if not finished:
            engine.abort(request.request_id)


def generate(engine: Engine, request: GenerationRequest, timeout: float | None = None) -> GenerationOutput:
    """Run one request to the end; returns one output holding all tokens, text and logprobs, with the final
    counts."""
    token_ids: list[int] = []
    text: list[str] = []
    logprobs: list[TokenLogprobs] = []
    prompt_logprobs = None
    for output in iterate_outputs(engine, request, timeout):
        token_ids.extend(output.new_token_ids)
        text.append(output.new_text)
        logprobs.extend(output.logprobs or ())
        prompt_logprobs = output.prompt_logprobs or prompt_logprobs
    output.new_token_ids, output.new_text = token_ids, "".join(text)
    output.logprobs = logprobs if request.sampling.logprobs is not None else None
    output.prompt_logprobs = prompt_logprobs
    return output
