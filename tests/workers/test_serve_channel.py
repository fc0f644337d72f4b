"""`serve_channel` draining a remote worker, with a scripted server end: the order of what it sends decides what
the server resumes elsewhere, so it is checked message by message."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from harness.waiting import wait_for
from server.engine.api import GenerationOutput, GenerationRequest, OutputSink, RequestId, SamplingParams
from server.workers.protocol import Draining, Message, Out, Submit
from server.workers.worker import serve_channel

RETURNED = "serve_channel returned"  # marks, among the messages sent, when serving ended (the caller's Bye)


class ScriptedChannel:
    """The server's end of a worker's link: hands out `incoming`, records what the worker sends. Sending a
    final output takes until the serve loop has looked at its requests once more after the send began (two
    receives begun), or has returned: a drain that ends before a request's final output is on the link shows
    as that output recorded after RETURNED."""

    def __init__(self, *incoming: Message) -> None:
        self.sent: list[Message | str] = []
        self._incoming: queue.SimpleQueue[Message] = queue.SimpleQueue()
        for message in incoming:
            self._incoming.put(message)
        self._receives = 0
        self._returned = False
        self._changed = threading.Condition()

    def recv(self, timeout_s: float | None = None) -> Message | None:
        with self._changed:
            self._receives += 1
            self._changed.notify_all()
        try:
            return self._incoming.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def send(self, message: Message) -> None:
        with self._changed:
            if isinstance(message, Out) and message.output.finished:
                begun = self._receives
                self._changed.wait_for(lambda: self._receives >= begun + 2 or self._returned, timeout=10)
            self.sent.append(message)

    def mark_returned(self) -> None:
        with self._changed:
            self._returned = True
            self.sent.append(RETURNED)
            self._changed.notify_all()


class HeldEngine:
    """Takes requests and emits nothing by itself: the test emits each output, as the engine thread would."""

    def __init__(self) -> None:
        self.sinks: dict[RequestId, OutputSink] = {}

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        self.sinks[request.request_id] = sink

    def abort(self, request_id: RequestId) -> None:
        self.sinks.pop(request_id, None)


def test_a_draining_worker_sends_each_final_output_before_it_stops_serving() -> None:
    """Otherwise the worker's Bye can overtake a request's last output, and the server resumes a request that
    had finished (a migration for nothing, or a token too many)."""
    request = GenerationRequest(RequestId("r"), [1, 2, 3], SamplingParams(max_tokens=1))
    channel, engine, stop = ScriptedChannel(Submit(0, request)), HeldEngine(), threading.Event()

    def serve() -> str:
        reason = serve_channel(channel, engine, stop, server_timeout_s=None, drain_s=30.0)  # type: ignore[arg-type]
        channel.mark_returned()
        return reason

    with ThreadPoolExecutor(1) as pool:
        serving = pool.submit(serve)
        wait_for(lambda: "r" in engine.sinks, 10, 0.01, what="the request accepted")
        stop.set()  # SIGTERM
        wait_for(lambda: any(isinstance(m, Draining) for m in channel.sent), 10, 0.01, what="Draining sent")
        engine.sinks["r"](GenerationOutput(RequestId("r"), [7], " x", True, "length", 3, 0, 1))
        assert serving.result(timeout=10) == "signal"
    assert [type(m).__name__ if m != RETURNED else m for m in channel.sent] == [
        "Accepted",
        "Draining",
        "Out",
        RETURNED,
    ]
