"""A deterministic fake engine of the Engine Protocol and a uvicorn server on a free port for the frontend tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from harness.ports import free_port
from harness.waiting import wait_for
from server.engine.api import (
    GenerationOutput,
    GenerationRequest,
    OutputSink,
    PoolStats,
    RequestError,
    RequestId,
    TokenLogprobs,
)
from server.openai.app import build_app
from server.openai.metrics import FrontendMetrics


class FakeEngine:
    """Token i of every answer is " t{i}" (id 1000 + i); the sink is called from a thread per request.

    Prompt tokens are the text's bytes; the first 4 prompt tokens count as cached; `step_s` paces the steps.
    `stop` strings are honoured on whole tokens, `seed` shifts the token ids so seeded choices differ.
    Logprobs: token i of the answer has -0.5 * (i + 1), its alternatives `token_logprobs` below; prompt token j
    (after the first) has -0.25 * j.
    """

    model_name = "fake"
    max_model_len = 256
    max_tokens_limit = 256
    block_layout = None
    healthy = True

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.submit_s = 0.0  # how long submit blocks (a remote worker's round trip)
        self.submitted: list[GenerationRequest] = []
        self.aborted: list[RequestId] = []
        self.chat_calls: list[tuple[list, Any]] = []  # (turns, tools) given to apply_chat_template
        self._abort_events: dict[RequestId, threading.Event] = {}

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids) -> str:
        return "".join(bytes([t]).decode(errors="replace") if t < 256 else f" t{t - 1000}" for t in token_ids)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], tools=None) -> list[int]:
        self.chat_calls.append((list(messages), tools))
        if any(m.get("name") == "refused" for m in messages):
            raise RequestError("messages", "the fake template refuses this name")
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        if len(request.prompt_token_ids) + request.sampling.max_tokens > self.max_model_len:
            raise RequestError("prompt_token_ids", "too long")
        if self.submit_s:
            time.sleep(self.submit_s)  # the behaviour under test: an engine slow to accept a request
        self.submitted.append(request)
        abort = self._abort_events[request.request_id] = threading.Event()
        threading.Thread(target=self._run, args=(request, sink, abort), daemon=True).start()

    def abort(self, request_id: RequestId) -> None:
        self.aborted.append(request_id)
        self._abort_events[request_id].set()

    def stats(self) -> PoolStats:
        running = sum(not event.is_set() for event in self._abort_events.values())
        return PoolStats(
            num_blocks=0,
            num_free_blocks=0,
            num_cached_blocks=0,
            num_running=running,
            num_waiting=0,
            num_preemptions=0,
        )

    def close(self) -> None:
        for abort in self._abort_events.values():
            abort.set()

    def _run(self, request: GenerationRequest, sink: OutputSink, abort: threading.Event) -> None:
        prompt = len(request.prompt_token_ids)
        cached = min(4, prompt)
        shift = request.sampling.seed or 0
        for i in range(request.sampling.max_tokens):
            if abort.wait(self.step_s) if self.step_s else abort.is_set():
                sink(GenerationOutput(request.request_id, [], "", True, "abort", prompt, cached, i))
                return
            text = f" t{i + shift}"
            stop = text.strip() in request.sampling.stop
            last = stop or i + 1 == request.sampling.max_tokens
            reason = ("stop" if stop else "length") if last else None
            output = GenerationOutput(
                request.request_id,
                [1000 + i + shift],
                "" if stop else text,
                last,
                reason,
                prompt,
                cached,
                i + 1,
            )
            if request.sampling.logprobs is not None:
                output.logprobs = [
                    token_logprobs(1000 + i + shift, -0.5 * (i + 1), request.sampling.logprobs)
                ]
            if i == 0 and request.sampling.prompt_logprobs is not None:
                ids, k = request.prompt_token_ids, request.sampling.prompt_logprobs
                output.prompt_logprobs = [None] + [
                    token_logprobs(t, -0.25 * j, k) for j, t in enumerate(ids) if j
                ]
            sink(output)
            if last:
                return


def token_logprobs(token_id: int, logprob: float, count: int) -> TokenLogprobs:
    """The fake's logprobs of `token_id`: itself the most likely, then ids 1, 2, ... each 1 nat less likely."""
    text = FakeEngine.decode(None, [token_id])
    top_ids = [token_id, *range(1, count)][:count]
    return TokenLogprobs(
        token_id, logprob, top_ids, [logprob - r for r in range(count)], text,
        [FakeEngine.decode(None, [t]) for t in top_ids],
    )  # fmt: skip


def _wait_started(server: uvicorn.Server, thread: threading.Thread, timeout_s: float = 10.0) -> None:
    """uvicorn sets `started` and signals nothing: polled, with a deadline."""
    wait_for(lambda: server.started or not thread.is_alive(), timeout_s, 0.005, what="uvicorn started")
    if not server.started:
        raise RuntimeError("uvicorn did not start")


class Served:
    def __init__(self, engine: FakeEngine, metrics: FrontendMetrics, base_url: str) -> None:
        self.engine = engine
        self.metrics = metrics
        self.base_url = base_url


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a free port in a thread; yields its base URL; always stops it."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait_started(server, thread)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def served(fake_engine: FakeEngine) -> Iterator[Served]:
    """The frontend over `fake_engine` (model name "fake") served by uvicorn on a free port; always stopped."""
    metrics = FrontendMetrics.create(CollectorRegistry())
    with serve_app(build_app({"fake": fake_engine}, metrics)) as base_url:
        yield Served(fake_engine, metrics, base_url)
