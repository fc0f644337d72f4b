"""vLLM's KV cache events become Strata tier events with Strata's own block hashes (no vLLM needed: the events are
built with the Structs vLLM 0.32 encodes, and sent as its ZMQ publisher frames them)."""

from __future__ import annotations

import queue
import tempfile
import uuid

import msgspec
import pytest
import zmq

from kvbm.block_hash import block_hashes, model_salt, request_salt
from kvbm.events import G1, TierEvent
from server.vllm_engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRelay,
    KVEventTranslator,
)

BLOCK = 4
SALT = model_salt("vllm|test|float32|bs4")


def stored(vllm_hashes, parent, tokens, extra_keys=None):
    return BlockStored(vllm_hashes, parent, tokens, BLOCK, None, "GPU", None, extra_keys)


def batch(*events):
    return KVEventBatch(1.0, list(events))


def test_a_chain_stored_in_two_events_has_strata_hashes():
    translator = KVEventTranslator("w0", BLOCK, SALT)
    tokens = list(range(100, 112))  # three blocks
    first = translator.translate(batch(stored([b"a" * 32, b"b" * 32], None, tokens[:8])))
    second = translator.translate(batch(stored([b"c" * 32], b"b" * 32, tokens[8:])))
    expected = block_hashes(tokens, BLOCK, SALT)
    assert first == [TierEvent("w0", "stored", G1, tuple(expected[:2]), timestamp=first[0].timestamp)]
    assert second[0].block_hashes == (expected[2],)
    assert translator.num_blocks == 3


def test_a_cache_salt_in_the_first_blocks_extra_keys_starts_the_requests_chain():
    translator = KVEventTranslator("w0", BLOCK, SALT)
    tokens = list(range(8))
    events = translator.translate(batch(stored([11, 12], None, tokens, [["tenant-a"], None])))
    assert list(events[0].block_hashes) == block_hashes(tokens, BLOCK, request_salt(SALT, "tenant-a"))
    assert list(events[0].block_hashes) != block_hashes(tokens, BLOCK, SALT)


def test_removed_and_cleared_blocks_leave_the_index():
    translator = KVEventTranslator("w0", BLOCK, SALT)
    tokens = list(range(12))
    hashes = block_hashes(tokens, BLOCK, SALT)
    translator.translate(batch(stored([1, 2, 3], None, tokens)))
    removed = translator.translate(batch(BlockRemoved([3, 99], "GPU")))  # 99: never stored, ignored
    assert removed[0].kind == "removed" and removed[0].block_hashes == (hashes[2],)
    cleared = translator.translate(batch(AllBlocksCleared()))
    assert sorted(cleared[0].block_hashes) == sorted(hashes[:2]) and translator.num_blocks == 0


def test_blocks_strata_cannot_key_are_not_indexed():
    translator = KVEventTranslator("w0", BLOCK, SALT)
    assert translator.translate(batch(stored([5], 404, list(range(4))))) == []  # its parent was never seen
    lora = BlockStored([6], None, list(range(4)), BLOCK, 1, "GPU", "adapter", None)
    assert translator.translate(batch(lora)) == []
    multimodal = stored([7], None, list(range(4)), [["mm-hash", 0]])
    assert translator.translate(batch(multimodal)) == []
    other_size = BlockStored([8], None, list(range(8)), 8, None, "GPU", None, None)
    assert translator.translate(batch(other_size)) == []
    assert translator.num_blocks == 0


class Sink:
    def __init__(self):
        self.events: queue.SimpleQueue[TierEvent] = queue.SimpleQueue()

    def publish(self, event):
        self.events.put(event)


@pytest.fixture
def publisher():
    endpoint = f"ipc://{tempfile.gettempdir()}/strata-test-kv-{uuid.uuid4().hex[:8]}"
    socket = zmq.Context.instance().socket(zmq.PUB)
    socket.bind(endpoint)
    yield endpoint, socket
    socket.close(0)


def test_the_relay_reads_vllms_frames_off_zmq(publisher):
    endpoint, socket = publisher
    sink = Sink()
    relay = KVEventRelay(endpoint, "w1", BLOCK, SALT, sink)
    try:
        tokens = list(range(8))
        payload = msgspec.msgpack.encode(batch(stored([1, 2], None, tokens)))
        event = None
        for seq in range(50):  # a SUB socket misses what is sent before it has joined: resend until heard
            socket.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
            try:
                event = sink.events.get(timeout=0.1)
                break
            except queue.Empty:
                continue
        assert event is not None and event.worker_id == "w1"
        assert list(event.block_hashes) == block_hashes(tokens, BLOCK, SALT)
        socket.send_multipart([b"kv", (99).to_bytes(8, "big"), b"\xc1 not msgpack"])  # logged, ignored
        socket.send_multipart(
            [b"kv", (100).to_bytes(8, "big"), msgspec.msgpack.encode(batch(BlockRemoved([2])))]
        )
        assert sink.events.get(timeout=5).kind == "removed"
        assert relay.num_cached_blocks == 1
    finally:
        relay.close()
