"""The worker link's two hot paths between two processes, against the alternatives, in the same run.

    python bench/worker_transport.py [--round-trips 5000] [--repeats 3]

A call's round trip (server -> worker submit, worker -> server answer) and a stream of GenerationOutputs (worker ->
server, one per token per request; "sender us" is the engine thread's time per send). The worker channel with its
typed msgspec messages (server/workers/protocol.py), against the same ZMQ ipc sockets carrying pickled tuples (the
protocol before it) and multiprocessing.Pipe (the alternative ZMQ was chosen over). Each link is measured
`--repeats` times, the links interleaved; medians reported. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from harness.stats import summary_us  # noqa: E402
from server.engine.api import GenerationOutput, GenerationRequest, RequestId, SamplingParams  # noqa: E402
from server.workers.protocol import Accepted, Codec, Out, Submit, ToServer, ToWorker  # noqa: E402
from server.workers.transport import Channel, ChannelAddress  # noqa: E402

_SAMPLE_OUTPUT = GenerationOutput(
    RequestId("0123456789abcdef0123456789abcdef-0"), [1234], " hello", False, None, 2048, 1024, 17
)
_SAMPLE_REQUEST = GenerationRequest(
    RequestId("0123456789abcdef0123456789abcdef-0"),
    list(range(2048)),
    SamplingParams(max_tokens=64, temperature=0.0),
)
_WARMUP_CALLS = 200


@dataclass(slots=True)
class _DataclassOutput:
    """GenerationOutput as it was when the link pickled it (a slots dataclass): what the pickle rows send."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    retryable: bool = False
    kv_transfer_params: bytes | None = (
        None  # the fields GenerationOutput gained since, so both rows send the same content
    )


@dataclass(slots=True)
class _DataclassSampling:
    """SamplingParams as it was (the fields a request sets here; the rest were defaults of the same kinds)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass(slots=True)
class _DataclassRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: _DataclassSampling


_PICKLED_OUTPUT = _DataclassOutput(*msgspec.structs.astuple(_SAMPLE_OUTPUT))
_PICKLED_REQUEST = _DataclassRequest(
    _SAMPLE_REQUEST.request_id,
    _SAMPLE_REQUEST.prompt_token_ids,
    _DataclassSampling(*msgspec.structs.astuple(_SAMPLE_REQUEST.sampling)),
)


class _TypedLink:
    """The worker channel as it is: msgspec Structs (server/workers/protocol.py)."""

    def __init__(self, address: ChannelAddress, server_side: bool) -> None:
        self.channel = Channel(address, server_side)

    def call(self, call_id: int) -> None:
        self.channel.send(Submit(call_id, _SAMPLE_REQUEST))

    def answer(self, call: Any) -> None:
        self.channel.send(Accepted(call.call_id))

    def send_output(self, output: GenerationOutput) -> None:
        self.channel.send(Out(output))

    def recv(self) -> Any:
        return self.channel.recv()

    def close(self) -> None:
        self.channel.close()


class _PickledLink:
    """The worker channel as it was: the same ZMQ PUSH/PULL ipc sockets and send lock, pickled tuples."""

    def __init__(self, address: ChannelAddress, server_side: bool) -> None:
        import zmq

        self._context = zmq.Context()
        self._out, self._in = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
        out_endpoint, in_endpoint = (
            (address.to_worker, address.to_server) if server_side else (address.to_server, address.to_worker)
        )
        for sock, endpoint in ((self._out, out_endpoint), (self._in, in_endpoint)):
            sock.setsockopt(zmq.LINGER, 0 if server_side else 2000)
            if server_side:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        self._lock = threading.Lock()

    def _send(self, *message: Any) -> None:
        with self._lock:
            self._out.send_pyobj(message)

    def call(self, call_id: int) -> None:
        self._send("call", call_id, "submit", (_PICKLED_REQUEST,))

    def answer(self, call: Any) -> None:
        self._send("reply", call[1], "ok", None)

    def send_output(self, output: GenerationOutput) -> None:
        self._send("out", _PICKLED_OUTPUT)

    def recv(self) -> Any:
        return self._in.recv_pyobj()

    def close(self) -> None:
        self._out.close()
        self._in.close()
        self._context.term()


class _PipeLink(_PickledLink):
    """multiprocessing.Pipe, pickled tuples."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection
        self._lock = threading.Lock()

    def _send(self, *message: Any) -> None:
        with self._lock:
            self._connection.send(message)

    def recv(self) -> Any:
        return self._connection.recv()

    def close(self) -> None:
        self._connection.close()


def _open_link(kind: str, endpoint: Any, server_side: bool) -> Any:
    if kind == "pipe":
        return _PipeLink(endpoint)
    return (_TypedLink if kind == "msgspec" else _PickledLink)(endpoint, server_side)


def _worker_side(kind: str, endpoint: Any, count: int, control: Any) -> None:
    """Answer the calls, then stream `count` outputs and report the time spent sending them (on `control`)."""
    link = _open_link(kind, endpoint, server_side=False)
    for _ in range(_WARMUP_CALLS + count):
        link.answer(link.recv())
    started = time.perf_counter()
    for _ in range(count):
        link.send_output(_SAMPLE_OUTPUT)
    control.send(time.perf_counter() - started)
    control.recv()  # the server side has read everything
    link.close()


def _measure_link(kind: str, count: int) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    control, child_control = context.Pipe()
    if kind == "pipe":
        endpoint, child_endpoint = context.Pipe()
    else:
        endpoint = child_endpoint = ChannelAddress.fresh()
    link = _open_link(kind, endpoint, server_side=True)  # binds first: the worker connects to it
    child = context.Process(target=_worker_side, args=(kind, child_endpoint, count, child_control))
    child.start()
    for call_id in range(_WARMUP_CALLS):
        link.call(call_id)
        link.recv()
    samples = []
    for call_id in range(count):
        started = time.perf_counter()
        link.call(call_id)
        link.recv()
        samples.append(time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(count):
        link.recv()
    elapsed = time.perf_counter() - started
    sender_s = control.recv()
    control.send("done")
    child.join()
    link.close()
    return {
        **summary_us(samples),
        "stream_msgs_per_s": round(count / elapsed),
        "sender_us_per_msg": round(sender_s / count * 1e6, 2),
    }


_LINKS = (
    ("zmq-ipc msgspec (now)", "msgspec"),
    ("zmq-ipc pickle (before)", "pickle"),
    ("multiprocessing.Pipe pickle", "pipe"),
)


def _codec_costs(count: int) -> dict[str, dict[str, float]]:
    """One output message encoded and decoded in this process: the codec's share of each send, without IPC."""
    codec_out, codec_in = Codec(ToWorker), Codec(ToServer)
    message, legacy = Out(_SAMPLE_OUTPUT), ("out", _PICKLED_OUTPUT)
    frame, pickled = codec_out.encode(message), pickle.dumps(legacy, pickle.DEFAULT_PROTOCOL)

    def per_call(fn: Any) -> float:
        started = time.perf_counter()
        for _ in range(count):
            fn()
        return round((time.perf_counter() - started) / count * 1e6, 2)

    return {
        "msgspec": {
            "encode_us": per_call(lambda: codec_out.encode(Out(_SAMPLE_OUTPUT))),
            "decode_us": per_call(lambda: codec_in.decode(frame)),
            "bytes": len(frame),
        },
        "pickle": {
            "encode_us": per_call(lambda: pickle.dumps(legacy, pickle.DEFAULT_PROTOCOL)),
            "decode_us": per_call(lambda: pickle.loads(pickled)),
            "bytes": len(pickled),
        },
    }


def transport_command(args: argparse.Namespace) -> dict:
    """Each link measured `--repeats` times, the links interleaved (these machines are noisy); medians reported."""
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name, _ in _LINKS}
    for _ in range(args.repeats):
        for name, kind in _LINKS:
            rounds[name].append(_measure_link(kind, args.round_trips))
    results = {
        name: {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        for name, rows in rounds.items()
    }
    now, before = results["zmq-ipc msgspec (now)"], results["zmq-ipc pickle (before)"]
    return {
        "bench": "worker_transport",
        "count": args.round_trips,
        "repeats": args.repeats,
        "results": results,
        "codec": _codec_costs(100_000),
        "msgspec_vs_pickle": {
            "stream_msgs_per_s": round(now["stream_msgs_per_s"] / before["stream_msgs_per_s"], 2),
            "sender_us_per_msg": round(now["sender_us_per_msg"] / before["sender_us_per_msg"], 2),
            "rtt_p50": round(now["p50_us"] / before["p50_us"], 2),
        },
        "rounds": rounds,
    }


def print_transport_table(report: dict) -> None:
    print(
        f"worker link between two processes: {report['count']} submit round trips (a 2,048-token request), then a "
        f"stream of {report['count']} GenerationOutputs (worker -> server); medians of {report['repeats']} rounds"
    )
    print(f"{'link':<30}{'RTT p50 us':>11}{'p99 us':>9}{'stream msg/s':>14}{'sender us/msg':>15}")
    for name, row in report["results"].items():
        print(
            f"{name:<30}{row['p50_us']:>11}{row['p99_us']:>9}{round(row['stream_msgs_per_s']):>14,}"
            f"{row['sender_us_per_msg']:>15}"
        )
    ratio = report["msgspec_vs_pickle"]
    print(
        f"msgspec / pickle on ZMQ: stream {ratio['stream_msgs_per_s']}x msg/s, {ratio['sender_us_per_msg']}x sender "
        f"time per message, {ratio['rtt_p50']}x RTT p50"
    )
    print(f"{'one output message, in process':<30}{'encode us':>11}{'decode us':>11}{'bytes':>7}")
    for name, row in report["codec"].items():
        print(f"{name:<30}{row['encode_us']:>11}{row['decode_us']:>11}{row['bytes']:>7}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--round-trips", type=int, default=5000)
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds of every link, interleaved; medians shown"
    )
    report = transport_command(parser.parse_args())
    print_transport_table(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
