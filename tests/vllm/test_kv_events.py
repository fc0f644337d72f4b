"""vLLM's KV cache events become Strata tier events with Strata's own block hashes. The translator and relay tests
need no vLLM: they build the events with Strata's copies of vLLM's Structs. The peer tests hold those copies to
vLLM itself: kv_events_peer.py, run under the vLLM venv, has vLLM's own ZMQ publisher send events built as vLLM's
Structs, and reports how vLLM declares them; a field or event type vLLM adds fails them until Strata copies it or
NOT_COPIED says why the index loses nothing without it."""

from __future__ import annotations

import queue
import subprocess
import tempfile
import typing
import uuid
from pathlib import Path
from typing import Any

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


PEER = Path(__file__).with_name("kv_events_peer.py")

# The events the peer builds with vLLM's Structs: first with every field vLLM declares set to something other than
# its default, then with only the fields vLLM requires. vLLM's hashes are bytes (sha256) or uint64s (xxhash, or
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); extra_keys are per block: LoRA name, (mm identifier, offset), cache salt.
EVERY_FIELD: dict[str, dict[str, Any]] = {
    "BlockStored": {
        "block_hashes": [b"\x01" * 32, 2**64 - 1],
        "parent_block_hash": b"\x02" * 32,
        "token_ids": list(range(100, 108)),
        "block_size": BLOCK,
        "lora_id": 3,
        "medium": "CPU",
        "lora_name": "adapter",
        "extra_keys": [["adapter", ["mm-hash", 2], "tenant-a"], None],
        "group_idx": 1,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 128,
        "locality": "REMOTE",
        "ownership": "kvcr",
        "session_id": "session-1",
    },
    "BlockRemoved": {
        "block_hashes": [b"\x01" * 32, 2**64 - 1],
        "medium": "CPU",
        "group_idx": 1,
        "locality": "REMOTE",
        "ownership": "kvcr",
    },
}
REQUIRED_ONLY: dict[str, dict[str, Any]] = {
    "BlockStored": {
        "block_hashes": [7],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    },
    "BlockRemoved": {"block_hashes": [7], "medium": "GPU"},
}
BATCHES = [
    {"ts": 1.25, "events": [[name, fields] for name, fields in EVERY_FIELD.items()]},
    {
        "ts": 2.5,
        "events": [*([name, fields] for name, fields in REQUIRED_ONLY.items()), ["AllBlocksCleared", {}]],
    },
    {"ts": 3.75, "events": []},
]

# The fields of vLLM's events Strata's copies leave out (msgspec skips a field its Struct lacks), and why the index
# can do without them. A field vLLM adds is neither copied nor here, and fails the declaration test.
NOT_COPIED = {
    "BlockStored": {
        "group_idx": "the KV cache group: Strata follows vLLM's first group only (connector.py takes "
        "kv_cache_groups[0]); a model of one group always sends 0, a hybrid model's groups are not told apart",
        "kv_cache_spec_kind": "set only by vLLM's simple CPU offload manager, which Strata does not configure",
        "kv_cache_spec_sliding_window": "set only by vLLM's simple CPU offload manager, as kv_cache_spec_kind",
        "locality": "set only by vLLM's offloading tiers (kv_offload), which Strata does not configure",
        "ownership": "set only by vLLM's offloading tiers (kv_offload), which Strata does not configure",
        "session_id": "the request that stored or reused the block; not part of the block's key",
    },
    "BlockRemoved": {
        "group_idx": "as BlockStored's group_idx",
        "locality": "as BlockStored's locality",
        "ownership": "as BlockStored's ownership",
    },
}


@pytest.fixture(scope="module")
def vllm_peer(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """kv_events_peer.py's report on BATCHES (see its docstring)."""
    report = tmp_path_factory.mktemp("kv-events") / "report.msgpack"
    run = subprocess.run(
        [vllm_python, str(PEER), str(report)],
        input=msgspec.msgpack.encode(BATCHES),
        capture_output=True,
        timeout=300,
    )
    assert run.returncode == 0, f"{PEER.name} under {vllm_python} failed:\n{run.stderr.decode()[-3000:]}"
    return msgspec.msgpack.decode(report.read_bytes())


def strata_event_types() -> dict[str, type[msgspec.Struct]]:
    """The event Structs Strata's KVEventBatch decodes, by name (their tags)."""
    (union,) = typing.get_args(typing.get_type_hints(KVEventBatch)["events"])
    return {cls.__name__: cls for cls in typing.get_args(union)}


def test_strata_decodes_every_field_of_what_vllms_publisher_sends(vllm_peer):
    frames = vllm_peer["frames"]
    assert [len(message) for message in frames] == [3] * len(BATCHES), "the relay reads [topic, seq, payload]"
    assert [topic for topic, _, _ in frames] == [b"kv"] * len(BATCHES)
    assert {len(seq) for _, seq, _ in frames} == {8}
    seqs = [int.from_bytes(seq, "big", signed=True) for _, seq, _ in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(BATCHES))), "the relay counts lost batches by seq"
    decoder = msgspec.msgpack.Decoder(KVEventBatch)  # as KVEventRelay decodes
    for (_, _, payload), sent in zip(frames, BATCHES, strict=True):
        batch = decoder.decode(payload)
        assert (batch.ts, batch.data_parallel_rank) == (sent["ts"], 0)  # the publisher sets its rank
        assert [type(event).__name__ for event in batch.events] == [name for name, _ in sent["events"]]
        for event, (name, fields) in zip(batch.events, sent["events"], strict=True):
            # a field the peer left out is at vLLM's default, None
            expected = {field: fields.get(field) for field in event.__struct_fields__}
            assert msgspec.structs.asdict(event) == expected, (
                f"{name} as vLLM {vllm_peer['vllm_version']} sent it"
            )


def test_strata_copies_every_event_type_and_field_vllm_declares(vllm_peer):
    version = vllm_peer["vllm_version"]
    events = strata_event_types()
    assert sorted(events) == sorted(vllm_peer["event_types"]), f"vLLM {version} batches other event types"
    copies = {"KVEventBatch": KVEventBatch, **events}
    for name, declared in vllm_peer["structs"].items():
        copy = copies[name]
        fields = msgspec.structs.fields(copy)
        not_copied = NOT_COPIED.get(name, {})
        assert set(not_copied) <= set(declared["fields"]), (
            f"{name}: NOT_COPIED names fields vLLM {version} lacks"
        )
        copied = [field for field in declared["fields"] if field not in not_copied]
        assert [field.encode_name for field in fields] == copied, (
            f"{name}: Strata's copy differs from vLLM {version}'s fields {declared['fields']}, less NOT_COPIED"
        )
        required = {field.encode_name for field in fields if field.required}
        assert required <= set(declared["required"]), f"{name}: vLLM omits a field at its default value"
        config = copy.__struct_config__
        framing = (declared["tag_field"], declared["tag"], declared["array_like"])
        assert (config.tag_field, config.tag, config.array_like) == framing, f"{name}: not framed as vLLM's"
        if name in EVERY_FIELD:
            assert sorted(EVERY_FIELD[name]) == sorted(declared["fields"]), (
                f"EVERY_FIELD misses {name} fields"
            )


def test_a_cache_salt_reaches_the_events_as_the_bare_string(vllm_peer):
    """The translator keys a salted request's chain by its first block's extra keys being [salt]."""
    assert vllm_peer["salt_extra_keys"] == [["tenant-a"], None]
