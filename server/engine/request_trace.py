"""The spans one traced request leaves in an engine (server/tracing.py): made only for a request that carries a
`trace_context`, so an untraced one costs a None check at each hook.

    strata.engine.request      submit -> end (finish reason, tokens), under the router's or frontend's span
      strata.engine.queue      submit -> first admission
      strata.kvbm.onboard      one per tier read at admission: tier, blocks, bytes
      strata.kvbm.offload      blocks its allocation evicted, offloaded before their rows were reused
      strata.engine.prefill    one per prompt chunk forwarded: its first position and tokens
      strata.engine.decode     first token -> end: output tokens
    events: first_token, preempted (with the tokens to recompute), handed_back (its worker lost a rank)

Times are wall-clock nanoseconds (time.time_ns), as OpenTelemetry's; spans whose end is known when they are
recorded (tier reads, chunks) are made in one call at their end.
"""

from __future__ import annotations

import time
from typing import Any

from kvbm.api import TierRead
from server import tracing
from server.engine.api import GenerationOutput


class RequestTrace:
    __slots__ = ("span", "_queue", "_first_token_ns", "_ended")

    def __init__(self, span: Any, attributes: dict[str, Any], queue: bool) -> None:
        self.span = span
        self._queue = (
            tracing.start_span("strata.engine.queue", tracing.traceparent_of(span), attributes)
            if queue
            else None
        )
        self._first_token_ns: int | None = None
        self._ended = False

    @classmethod
    def start(
        cls,
        trace_context: str | None,
        request_id: str,
        num_prompt_tokens: int,
        engine: str,
        queue: bool = True,
    ) -> RequestTrace | None:
        """The trace of a request carrying `trace_context`, None for any other (or while tracing is off).
        `queue` False: an engine that does not say when a request leaves its queue (vLLM) has no queue span."""
        span = tracing.start_span(
            "strata.engine.request",
            trace_context,
            {
                "strata.request_id": request_id,
                "strata.engine": engine,
                "gen_ai.usage.input_tokens": num_prompt_tokens,
            },
        )
        return None if span is None else cls(span, {"strata.request_id": request_id}, queue)

    def admitted(self, num_cached_tokens: int) -> None:
        """Taken from the wait queue with `num_cached_tokens` of its prompt cached (G1 and lower tiers); the queue
        span ends at the first admission (Strata's engine, the only caller, always has one)."""
        if self._queue is None:
            self.span.add_event("readmitted", {"strata.cached_tokens": num_cached_tokens})
            return
        self.span.set_attribute("strata.usage.cached_tokens", num_cached_tokens)
        self._queue.end()
        self._queue = None

    def onboarded(self, reads: list[TierRead]) -> None:
        """Tier reads of one onboard (kvbm.api.KVConnector.onboard)."""
        for read in reads:
            tracing.record_span(
                "strata.kvbm.onboard",
                self.span,
                read.start_ns,
                read.end_ns,
                {
                    "strata.kvbm.tier": read.tier,
                    "strata.kvbm.blocks": read.blocks,
                    "strata.kvbm.bytes": read.bytes,
                },
            )

    def offloaded(self, start_ns: int, end_ns: int, num_blocks: int) -> None:
        """Its allocation evicted `num_blocks` cached blocks, offloaded to the tiers before their rows were reused."""
        attributes = {"strata.kvbm.blocks": num_blocks}
        tracing.record_span("strata.kvbm.offload", self.span, start_ns, end_ns, attributes)

    def prefilled(self, start_ns: int, end_ns: int, first_position: int, num_tokens: int) -> None:
        tracing.record_span(
            "strata.engine.prefill",
            self.span,
            start_ns,
            end_ns,
            {"strata.prefill.first_position": first_position, "strata.prefill.tokens": num_tokens},
        )

    def first_token(self) -> None:
        self._first_token_ns = time.time_ns()
        self.span.add_event("first_token", timestamp=self._first_token_ns)

    def preempted(self, num_tokens: int) -> None:
        self.span.add_event("preempted", {"strata.recompute_tokens": num_tokens})

    def observe(self, output: GenerationOutput) -> None:
        """For an engine that reports only its outputs (vLLM): the first with tokens is the first token, a finished
        one the end."""
        if self._first_token_ns is None and output.new_token_ids:
            self.span.set_attribute("strata.usage.cached_tokens", output.num_cached_tokens)
            self.first_token()
        if output.finished:
            self.end(output.finish_reason or "handed_off", output.num_output_tokens, output.error)

    def end(self, reason: str | None, num_output_tokens: int, error: str | None = None) -> None:
        """The request left this engine: finished (`reason`), handed back ("retryable") or handed off. Once."""
        if self._ended:
            return
        self._ended = True
        now = time.time_ns()
        if self._queue is not None:  # ended before admission
            self._queue.end(end_time=now)
            self._queue = None
        if self._first_token_ns is not None:
            tracing.record_span(
                "strata.engine.decode",
                self.span,
                self._first_token_ns,
                now,
                {"gen_ai.usage.output_tokens": num_output_tokens},
            )
        self.span.set_attributes(
            {"gen_ai.usage.output_tokens": num_output_tokens, "strata.finish_reason": reason or "none"}
        )
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end(end_time=now)
