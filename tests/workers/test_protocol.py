"""The worker protocol's messages: every kind round-trips typed; frames that are not messages are refused."""

from __future__ import annotations

import os
import pickle

import msgspec
import pytest

from kvbm.events import G2, TierEvent
from server.engine.api import (
    ChatTurn,
    GenerationOutput,
    GenerationRequest,
    PoolStats,
    RequestId,
    SamplingParams,
    StructuredOutput,
    TokenLogprobs,
    ToolCallTurn,
)
from server.workers.hardware import HardwareInfo, Speeds
from server.workers.protocol import (
    Abort,
    Accepted,
    Ack,
    ApplyChatTemplate,
    Attach,
    BadMessage,
    Beat,
    Busy,
    Bye,
    CallFailed,
    Codec,
    Decode,
    Draining,
    Encode,
    Event,
    Failed,
    Hello,
    Message,
    Out,
    Refused,
    Stop,
    Submit,
    Text,
    TokenIds,
    ToServer,
    ToWorker,
    WorkerInfo,
)

HARDWARE = HardwareInfo("host", "cpu", "Test CPU", "Test CPU", 2, 1, 2**34, 0, 100, 100 * 4096)
REQUEST = GenerationRequest(
    RequestId("r-1"),
    [1, 2, 3],
    SamplingParams(
        max_tokens=5,
        temperature=0.5,
        seed=2**63,
        stop=["\n"],
        stop_token_ids=[7],
        logit_bias={5: -1.5},
        logprobs=2,
        structured_outputs=StructuredOutput("json", '{"type": "object"}', "response_format", 1),
    ),
    cache_salt="tenant-a",
)
TO_WORKER = [
    Attach("server-1"),
    Submit(1, REQUEST),
    Encode(2, "héllo"),
    ApplyChatTemplate(
        3,
        [
            ChatTurn("user", "hi", "ann"),
            ChatTurn("assistant", "", None, [ToolCallTurn("c1", "get_weather", '{"city": "Oslo"}')]),
            ChatTurn("tool", '{"temp": 3}', None, [], "c1"),
        ],
        [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    ),
    Decode(4, [104, 195]),
    Abort(RequestId("r-1")),
    Ack(),
    Stop(),
]
TO_SERVER = [
    Hello(WorkerInfo("step", 256, 200, 4, 2**64 - 1, 123, HARDWARE, Speeds(5000.0, 80.0))),
    Failed("no weights"),
    Accepted(1),
    TokenIds(2, [104, 195]),
    Text(4, "h\u00e9"),
    Refused(3, "prompt", "too long"),
    CallFailed(4, "ValueError in worker"),
    Out(GenerationOutput(RequestId("r-1"), [1000], " t0", True, "length", 3, 2, 1, None, True)),
    Out(
        GenerationOutput(
            RequestId("r-1"),
            [1000],
            " t0",
            logprobs=[TokenLogprobs(1000, -0.5, [1000, 7], [-0.5, -2.0], " t0", [" t0", "x"])],
            prompt_logprobs=[None, TokenLogprobs(2, -1.0, [], [])],
        )
    ),
    Beat(PoolStats(100, 90, 5, 2, 1, 0)),
    Event(TierEvent("w0", "moved", G2, (1, 2**64 - 1), from_tier=1, timestamp=1.5, node="host:0")),
    Draining("worker shutting down"),
    Bye("worker shutting down"),
    Busy(5, "9 requests are waiting", 1.0),
]


def test_every_message_kind_round_trips_typed() -> None:
    assert {type(m) for m in TO_WORKER + TO_SERVER} == set(Message.__subclasses__())
    server_end, worker_end = Codec(ToServer), Codec(ToWorker)
    for message in TO_WORKER:
        assert worker_end.decode(server_end.encode(message)) == message
    for message in TO_SERVER:
        assert server_end.decode(worker_end.encode(message)) == message


def test_an_output_is_one_short_array() -> None:
    frame = Codec(ToWorker).encode(next(m for m in TO_SERVER if isinstance(m, Out)))
    assert msgspec.msgpack.decode(frame) == [
        "Out",
        ["r-1", [1000], " t0", True, "length", 3, 2, 1, None, True, None, None, None],
    ]


class _Exploit:
    def __reduce__(self):
        return os.system, ("touch /nonexistent/never",)


@pytest.mark.parametrize(
    "frame",
    [
        pickle.dumps(("call", 0, "submit", (_Exploit(),))),  # what the pickled protocol accepted
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode(["Zap", 1]),  # unknown kind
        Codec(ToServer).encode(Hello(TO_SERVER[0].info)),  # the other direction's kind
        Codec(ToServer).encode(Submit(1, REQUEST))[:-4],  # truncated
        msgspec.msgpack.encode(["Submit", 1, ["r", [1, "x"], []]]),  # a field of the wrong type
        msgspec.msgpack.encode(["Abort"]),  # a field missing
    ],
)
def test_frames_that_are_not_messages_are_refused(frame: bytes) -> None:
    with pytest.raises(BadMessage):
        Codec(ToWorker).decode(frame)


def test_oversized_frames_are_refused_both_ways() -> None:
    codec = Codec(ToWorker, max_message_bytes=64)
    with pytest.raises(BadMessage, match="over 64"):
        codec.decode(msgspec.msgpack.encode(["Encode", 1, "x" * 64]))
    with pytest.raises(BadMessage, match="over 64"):
        codec.encode(Encode(1, "x" * 64))
    assert codec.decode(codec.encode(Encode(1, "x" * 32))) == Encode(1, "x" * 32)


def test_values_out_of_range_are_refused() -> None:
    codec = Codec(ToServer)
    bad_tier = msgspec.msgpack.encode(
        ["Event", {"worker_id": "w", "kind": "stored", "tier": 9, "block_hashes": []}]
    )
    bad_hash = msgspec.msgpack.encode(
        ["Event", {"worker_id": "w", "kind": "stored", "tier": 1, "block_hashes": [-1]}]
    )
    bad_reason = msgspec.msgpack.encode(["Out", ["r", [], "", True, "done!", 0, 0, 0, None, False]])
    for frame in (bad_tier, bad_hash, bad_reason):
        with pytest.raises(BadMessage):
            codec.decode(frame)
