"""Run under the vLLM venv by test_kv_events.py: vLLM's own ZMQ publisher of KV events (made by vLLM's factory
from the config `VLLMEngine` sets: publisher "zmq", an ipc endpoint, topic "kv") publishes the batches the test
describes, built as vLLM's own Structs, and a SUB socket here records the frames it sends.

stdin (msgpack): a list of batches, each {"ts": seconds, "events": [[event class name, its fields], ...]}.
The file named by argv[1] (msgpack): the frames of those batches, in order; vLLM's declaration of each struct of
the wire (its fields in order, the required ones, its tag); the event types its KVEventBatch carries; and the
event shape of a cache salt (`to_event_extra_keys`), which Strata's translator reads."""

from __future__ import annotations

import sys
import tempfile
import time
import typing
import uuid
from pathlib import Path
from typing import Any

import msgspec
import vllm
import zmq
from vllm.config import KVEventsConfig
from vllm.distributed import kv_events
from vllm.distributed.kv_events import EventPublisher, EventPublisherFactory, KVEventBatch
from vllm.v1.core.kv_cache_utils import to_event_extra_keys

TIMEOUT_S = 60.0


def declaration(cls: type[msgspec.Struct]) -> dict[str, Any]:
    fields = msgspec.structs.fields(cls)
    config = cls.__struct_config__
    return {
        "fields": [field.encode_name for field in fields],
        "required": [field.encode_name for field in fields if field.required],
        "tag_field": config.tag_field,
        "tag": config.tag,
        "array_like": config.array_like,
    }


def event_types() -> list[type[msgspec.Struct]]:
    (union,) = typing.get_args(typing.get_type_hints(KVEventBatch)["events"])
    return list(typing.get_args(union))


def join(publisher: EventPublisher, sub: zmq.Socket) -> int:
    """Publishes empty batches until `sub` hears one (a SUB socket misses what is sent before it has joined);
    returns how many it published: the sequence number the next batch gets."""
    deadline = time.monotonic() + TIMEOUT_S
    sent = 0
    while time.monotonic() < deadline:
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        sent += 1
        if sub.poll(100):
            return sent
    raise TimeoutError(f"vLLM's publisher was not heard in {TIMEOUT_S:.0f} s")


def publish(batches: list[KVEventBatch]) -> list[list[bytes]]:
    endpoint = f"ipc://{tempfile.gettempdir()}/strata-test-vllm-kv-{uuid.uuid4().hex[:8]}"
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv")
    publisher = EventPublisherFactory.create(config, data_parallel_rank=0)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        probes = join(publisher, sub)
        for batch in batches:
            publisher.publish(batch)
        frames: list[list[bytes]] = []
        deadline = time.monotonic() + TIMEOUT_S
        while len(frames) < len(batches):
            if not sub.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError(f"{len(frames)} of {len(batches)} batches heard in {TIMEOUT_S:.0f} s")
            message = sub.recv_multipart()
            if len(message) == 3 and int.from_bytes(message[1], "big", signed=True) < probes:
                continue  # a late probe
            frames.append(message)
        return frames
    finally:
        publisher.shutdown()
        sub.close(0)


def main() -> None:
    described = msgspec.msgpack.decode(sys.stdin.buffer.read())
    batches = [
        KVEventBatch(
            ts=batch["ts"], events=[getattr(kv_events, name)(**fields) for name, fields in batch["events"]]
        )
        for batch in described
    ]
    types = event_types()
    report = {
        "vllm_version": vllm.__version__,
        "frames": publish(batches),
        "event_types": [cls.__name__ for cls in types],
        "structs": {cls.__name__: declaration(cls) for cls in [KVEventBatch, *types]},
        "salt_extra_keys": to_event_extra_keys([(("cache_salt", "tenant-a"),), None]),
    }
    Path(sys.argv[1]).write_bytes(msgspec.msgpack.encode(report))


if __name__ == "__main__":
    main()
