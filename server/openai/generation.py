"""One HTTP request's engine requests (n choices x prompts), bridged from the engine thread into asyncio.

The engine calls each sink from its own thread; the sink hands the output to the event loop through the loop's
`_Inbox` (one `call_soon_threadsafe` per burst of outputs, see there) into one `asyncio.Queue` per generation, so
the handler awaits outputs without polling. Closing a
`Generation` aborts every engine request that has not finished, which frees its KV blocks at once; a watcher task
closes it as soon as the client disconnects.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from server import tracing
from server.engine.api import Engine, GenerationOutput, GenerationRequest, RequestId, SamplingParams
from server.openai.metrics import FrontendMetrics

logger = logging.getLogger(__name__)

WaitForDisconnect = Callable[[], Awaitable[None]]


class ClientDisconnected(Exception):
    """The client went away; every unfinished engine request of the generation was aborted."""


_CLIENT_GONE = object()


class _Inbox:
    """Items from other threads into one event loop's queues, with one wakeup per burst.

    An engine emits a step's outputs back to back (32 streams: 32 sinks in a row). A `call_soon_threadsafe` each
    would wake the loop once per output (a write to its self-pipe each), and the loop's handlers would take the GIL
    from the engine thread between them, stretching the engine's time between two forwards. Here the first post of
    a burst schedules one drain and later posts only append, so the loop runs once the engine thread lets go of the
    GIL (its next forward) and takes the whole step at once.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[tuple[asyncio.Queue, object]] = deque()
        self._scheduled = False
        self._lock = threading.Lock()

    def post(self, queue: asyncio.Queue, item: object) -> None:
        """Put `item` into `queue` on the loop's thread, soon. Raises RuntimeError when the loop has closed."""
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            with self._lock:
                self._scheduled = False
            raise

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        for queue, item in items:
            queue.put_nowait(item)


_inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Inbox] = weakref.WeakKeyDictionary()


def _inbox(loop: asyncio.AbstractEventLoop) -> _Inbox:
    """The loop's inbox (made on the loop's thread, the first time a generation starts there)."""
    inbox = _inboxes.get(loop)
    if inbox is None:
        inbox = _inboxes[loop] = _Inbox(loop)
    return inbox


@dataclass(slots=True)
class _Track:
    """Timing of one engine request, for the latency histograms (monotonic seconds)."""

    submitted_at: float
    prompt_tokens: int
    last_token_at: float | None = None
    finished: bool = False


class Generation:
    """Submits engine requests, yields `(choice_index, output)` in arrival order, aborts leftovers on close."""

    def __init__(
        self,
        engine: Engine,
        metrics: FrontendMetrics,
        model: str,
        client_gone: WaitForDisconnect,
        request_id: str,
        span: Any = None,
    ) -> None:
        """`span`: the request's GenAI span while it is traced (served.py), ended with usage on `close`."""
        self._engine = engine
        self._metrics = metrics
        self._model = model
        self._inbox = _inbox(asyncio.get_running_loop())
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._tracks: dict[RequestId, _Track] = {}
        self._ids: list[RequestId] = []
        self._closed = False
        self._lock = threading.Lock()  # submit may run in a worker thread while the loop closes
        self._watcher = asyncio.create_task(self._watch(client_gone))
        self.request_id = request_id  # engine request i is f"{request_id}-{i}"
        self._span = span
        self._trace_context = tracing.traceparent_of(span)
        self._usage = [0, 0, 0]  # prompt, cached, output tokens of the finished engine requests (traced only)
        self._finish_reasons: list[str] = []

    def submit(
        self,
        prompts: list[tuple[list[int], SamplingParams]],
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Submit one engine request per (prompt, sampling), each with `cache_salt` and `priority`; choice i is
        prompts[i].
        Raises RequestError.

        Any thread may call it (an engine's submit can block: a worker round trip). Once `close` has run it submits
        no more, and a request whose submit was in progress during `close` is aborted right after it.
        """
        for index, (token_ids, sampling) in enumerate(prompts):
            request_id = RequestId(f"{self.request_id}-{index}")
            track = _Track(submitted_at=time.monotonic(), prompt_tokens=len(token_ids))
            with self._lock:
                if self._closed:
                    return
                self._tracks[request_id] = track
                self._ids.append(request_id)
            self._metrics.in_flight.labels(self._model).inc()
            self._metrics.queued.labels(self._model).inc()
            self._metrics.queued_prompt_tokens.labels(self._model).inc(track.prompt_tokens)
            try:
                self._engine.submit(
                    GenerationRequest(
                        request_id,
                        token_ids,
                        sampling,
                        cache_salt,
                        priority=priority,
                        trace_context=self._trace_context,
                    ),
                    self._sink(index),
                )
            except BaseException:
                self._forget(request_id, track)
                raise
            if self._closed:
                self._engine.abort(request_id)  # close ran during the submit; a second abort is harmless

    async def outputs(self) -> AsyncIterator[tuple[int, GenerationOutput]]:
        """Every output of every choice until all have finished; raises ClientDisconnected."""
        unfinished = len(self._ids)
        while unfinished:
            item = await self._queue.get()
            if item is _CLIENT_GONE:
                raise ClientDisconnected
            index, output = item  # type: ignore[misc]
            self._observe(output)
            unfinished -= output.finished
            yield index, output

    def close(self) -> None:
        """Abort every unfinished engine request (idempotent) and stop watching the client. Never waits for a
        submit in progress (see `submit`)."""
        self._watcher.cancel()
        self._closed = True
        self._end_span()
        with self._lock:
            unfinished = [(rid, self._tracks[rid]) for rid in self._ids if not self._tracks[rid].finished]
            for _, track in unfinished:
                track.finished = True
        for request_id, track in unfinished:
            self._engine.abort(request_id)
            self._release(track)
            logger.debug("aborted %s", request_id)

    def _forget(self, request_id: RequestId, track: _Track) -> None:
        """Undo the bookkeeping of a request the engine refused."""
        with self._lock:
            self._ids.remove(request_id)
            del self._tracks[request_id]
            release, track.finished = not track.finished, True
        if release:
            self._release(track)

    def _sink(self, index: int) -> Callable[[GenerationOutput], None]:
        def sink(output: GenerationOutput) -> None:
            try:
                self._inbox.post(self._queue, (index, output))
            except RuntimeError:  # the event loop has shut down: nobody is left to read this output
                logger.debug("dropped output of %s: event loop closed", output.request_id)

        return sink

    async def _watch(self, client_gone: WaitForDisconnect) -> None:
        await client_gone()
        logger.info("client disconnected from %s, aborting", self.request_id)
        self.close()
        self._queue.put_nowait(_CLIENT_GONE)

    def _observe(self, output: GenerationOutput) -> None:
        track = self._tracks.get(output.request_id)
        if track is None or track.finished:
            return
        now = time.monotonic()
        if output.new_token_ids:
            if track.last_token_at is None:
                self._metrics.time_to_first_token.labels(self._model).observe(now - track.submitted_at)
                if self._span is not None:
                    self._span.add_event("gen_ai.first_token", {"strata.request_id": output.request_id})
                self._metrics.queued.labels(self._model).dec()
                self._metrics.queued_prompt_tokens.labels(self._model).dec(track.prompt_tokens)
            else:
                gap = (now - track.last_token_at) / len(output.new_token_ids)
                self._metrics.inter_token_latency.labels(self._model).observe(gap)
            track.last_token_at = now
        if output.finished:
            if self._span is not None:
                self._traced_finish(output)
            track.finished = True
            self._release(track)
            self._metrics.request_duration.labels(self._model).observe(now - track.submitted_at)
            self._metrics.record_tokens(
                self._model, output.num_prompt_tokens, output.num_cached_tokens, output.num_output_tokens
            )

    def _traced_finish(self, output: GenerationOutput) -> None:
        self._usage[0] += output.num_prompt_tokens
        self._usage[1] += output.num_cached_tokens
        self._usage[2] += output.num_output_tokens
        self._finish_reasons.append(output.finish_reason or "none")

    def _end_span(self) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        prompt, cached, output = self._usage
        span.set_attributes(
            {
                "gen_ai.response.id": self.request_id,
                "gen_ai.usage.input_tokens": prompt,
                "gen_ai.usage.output_tokens": output,
                "strata.usage.cached_tokens": cached,
                "gen_ai.response.finish_reasons": self._finish_reasons,
            }
        )
        span.end()

    def _release(self, track: _Track) -> None:
        self._metrics.in_flight.labels(self._model).dec()
        if track.last_token_at is None:
            self._metrics.queued.labels(self._model).dec()
            self._metrics.queued_prompt_tokens.labels(self._model).dec(track.prompt_tokens)
