"""Everything that crosses between the server and a worker: the messages of the channel, both directions; what a
worker says about itself (`WorkerInfo`: in its hello, and as JSON in Redis); the router's view of its load.

Wire format: one ZMQ frame is one message, a msgspec Struct encoded with msgpack as an array: the kind's tag (its
class name), then its fields by position. The engine's types travel as they are (`GenerationRequest`,
`GenerationOutput` are Structs; `PoolStats`, `TierEvent`, `WorkerInfo` dataclasses). A receiver decodes a frame
with one msgspec Decoder of its direction's tagged union, so it gets a message whose every field has its declared
type, or `BadMessage`: not msgpack, truncated, an unknown tag (or one of the other direction), a field of the wrong
type, or over `MAX_MESSAGE_BYTES`. No frame can name code to run: there is no pickle on the link. Fields travel by
position, so both ends run the same Strata version (a spawned worker does by construction; a remote worker and its
server are deployed together).

server -> worker (`ToWorker`):
    Attach(server_id)                a server connecting to a remote worker (remote_worker.py)
    Submit(call_id, request) | Encode(call_id, text) | ApplyChatTemplate(call_id, messages)
    | Decode(call_id, token_ids)    engine calls, each answered by one Accepted/TokenIds/Text, Refused or
                                     CallFailed
    Abort(request_id)
    Ack()                            answers each Beat: a remote worker drops a server it no longer hears
    Stop()                           the server lets go: the worker aborts what is left (a spawned one exits)
worker -> server (`ToServer`):
    Hello(info) once the engine is built and calibrated, or Failed(message)
    Accepted(call_id)                the engine queued a Submit's request
    TokenIds(call_id, token_ids)     the answer to Encode and ApplyChatTemplate
    Text(call_id, text)              the answer to Decode
    Refused(call_id, field, message) the engine refused the call (RequestError), naming the input
    Busy(call_id, message, retry_after_s)  the engine's wait queue is full (EngineOverloaded): not queued
    CallFailed(call_id, message)     the engine failed (logged by the worker)
    Out(output)                      from the engine thread, one per step per request
    Beat(stats)                      every `heartbeat_s`; the server declares the worker dead without them
    Event(event)                     KVBM tier events, when the worker forwards them to the server's index
    Draining(reason)                 the worker takes nothing new (SIGTERM): the server routes nothing more to it;
                                     it finishes what it holds (up to its --exit-timeout-secs), then says Bye
    Bye(reason)                      the worker is leaving (what it still held is resumed elsewhere), or drops a
                                     server after a bad frame
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NewType

import msgspec

from kvbm.events import TierEvent
from server.engine.api import ChatTurn, GenerationOutput, GenerationRequest, PoolStats, RequestId
from server.workers.hardware import HardwareInfo, Speeds

WorkerId = NewType("WorkerId", str)  # the same id the worker's KVBM agent publishes events under

MAX_MESSAGE_BYTES = 16 << 20  # a longer frame is refused (a 128k-token prompt is under 1 MiB)


class BadMessage(ValueError):
    """A frame that is not a message of this protocol for its direction; the receiver drops its sender."""


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What the server learns from the worker's hello (and from Redis, as JSON, for a remote worker).
    `salt`/`block_size` key block hashes (None: not paged); `speeds` were measured at start (see hardware.py)."""

    model_name: str
    max_model_len: int  # tokens
    max_tokens_limit: int  # tokens
    block_size: int | None
    salt: int | None
    pid: int
    hardware: HardwareInfo | None = None
    speeds: Speeds = field(default_factory=Speeds)
    role: str = "both"  # prefill | decode | both (server/router/disagg.py)
    shards: str = (
        ""  # "tp<T>pp<P>" for a sharded Strata engine: the rank parts its KV tiers hold; "" unsharded
    )

    def summary(self) -> str:
        """One log line: where it runs and how fast it measured."""
        hw = self.hardware
        where = (
            f"{hw.host} {hw.device} ({hw.device_name}), {hw.cpu_cores} cores, {hw.torch_threads} threads, "
            f"{hw.memory_bytes / 2**30:.1f} GiB, KV {hw.kv_capacity_blocks} blocks / "
            f"{hw.kv_capacity_bytes / 2**20:.0f} MiB"
            if hw
            else "unknown hardware"
        )
        return f"{where}; prefill {self.speeds.prefill_tok_s:.0f} tok/s, decode {self.speeds.decode_tok_s:.1f} tok/s"


@dataclass(slots=True)
class WorkerStats:
    """A worker's load as the router sees it. Speeds are measured throughput (0 = not measured yet, treated as
    average)."""

    worker_id: WorkerId
    kv_capacity_blocks: int
    active_blocks: int = 0  # KV blocks held by running requests (decode load)
    in_flight: int = 0  # requests running or queued
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0


class Message(msgspec.Struct, array_like=True, tag=True):
    """Base of every message: encoded as [class name, *fields]."""


# ---- server -> worker ----


class Attach(Message):
    server_id: str


class Submit(Message):
    call_id: int
    request: GenerationRequest


class Encode(Message):
    call_id: int
    text: str


class ApplyChatTemplate(Message):
    call_id: int
    messages: list[ChatTurn]
    tools: list[dict[str, Any]] | None = None  # OpenAI's tool objects (JSON values)


class Decode(Message):
    call_id: int
    token_ids: list[int]


class Abort(Message):
    request_id: RequestId


class Ack(Message):
    pass


class Stop(Message):
    pass


# ---- worker -> server ----


class Hello(Message):
    info: WorkerInfo


class Failed(Message):
    message: str


class Accepted(Message):
    call_id: int


class TokenIds(Message):
    call_id: int
    token_ids: list[int]


class Text(Message):
    call_id: int
    text: str


class Refused(Message):
    call_id: int
    field: str
    message: str


class Busy(Message):
    call_id: int
    message: str
    retry_after_s: float


class CallFailed(Message):
    call_id: int
    message: str


class Out(Message):
    output: GenerationOutput


class Beat(Message):
    stats: PoolStats


class Event(Message):
    event: TierEvent


class Draining(Message):
    reason: str


class Bye(Message):
    reason: str


Call = Submit | Encode | ApplyChatTemplate | Decode
Answer = Accepted | TokenIds | Text | Refused | Busy | CallFailed
ToWorker = Attach | Submit | Encode | ApplyChatTemplate | Decode | Abort | Ack | Stop
ToServer = (
    Hello
    | Failed
    | Accepted
    | TokenIds
    | Text
    | Refused
    | Busy
    | CallFailed
    | Out
    | Beat
    | Event
    | Draining
    | Bye
)


class Codec:
    """Encodes messages and decodes the frames of one direction (`ToServer` on the server's end, `ToWorker` on the
    worker's). Not thread-safe: the channel encodes under its send lock and decodes on its one receiving thread."""

    def __init__(self, incoming: type, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = max_message_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)

    def encode(self, message: Message) -> bytes:
        """Raises BadMessage for a message over the size limit (the receiver would refuse it)."""
        frame = self._encoder.encode(message)
        if len(frame) > self.max_message_bytes:
            raise BadMessage(
                f"{type(message).__name__} of {len(frame)} bytes is over {self.max_message_bytes}"
            )
        return frame

    def decode(self, frame: bytes) -> Message:
        if len(frame) > self.max_message_bytes:
            raise BadMessage(f"{len(frame)} bytes is over {self.max_message_bytes}")
        try:
            return self._decoder.decode(frame)
        except msgspec.DecodeError as exc:
            raise BadMessage(str(exc)) from None
