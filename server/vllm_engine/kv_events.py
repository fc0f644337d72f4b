"""vLLM's KV cache events, re-keyed with Strata's block hashes, for the router's one KV index.

vLLM publishes a `KVEventBatch` per engine step on a ZMQ PUB socket (`kv_events_config`, publisher "zmq"): frames
[topic, sequence number (8 bytes, big-endian), msgpack payload]. The events this relay reads:

    BlockStored       block_hashes, parent_block_hash (None: the first block), token_ids (block_size per block),
                      extra_keys (per block, untagged: the cache_salt string on a salted request's first block)
    BlockRemoved      block_hashes
    AllBlocksCleared

vLLM's hashes are its own (sha256 of its pickled key, or xxhash with another seed), so the relay recomputes
Strata's chain (`kvbm.block_hash`) from each stored block's token ids and its parent's Strata hash, keeps vLLM's
hash -> Strata's for the blocks vLLM holds, and publishes TierEvents (G1, this worker) to the server's index: the
router scores a vLLM worker's prefix exactly as it scores one of Strata's engines. A block whose parent it never
saw (events lost), or whose key has more than a cache salt (LoRA, multimodal, prompt embeddings), is not indexed:
the router only underestimates what that worker holds.

The payload is decoded by msgspec into the Structs below (the fields Strata reads, as vLLM 0.32 declares them; the
rest are ignored), never unpickled.

`announce` publishes everything the worker holds again, for an index that missed it (a server that just attached a
remote worker, a KVBM service that restarted): the G1 blocks from the relay's map, then the tiers' blocks, which
StrataKVConnector's worker half announces when asked on its lookup socket (`Announce`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec
import zmq

from kvbm.block_hash import BlockHash, hash_block, request_salt
from kvbm.events import G1, EventSink, TierEvent, WireHash

logger = logging.getLogger(__name__)

VLLMHash = int | bytes
ANNOUNCE_TIMEOUT_MS = 5000


class Lookup(msgspec.Struct, tag=True, frozen=True):
    """StrataKVConnector's scheduler half asks its worker half: how many of these leading blocks do the tiers
    hold? Answered with Held."""

    block_hashes: list[WireHash]


class Announce(msgspec.Struct, tag=True, frozen=True):
    """The relay asks the connector's worker half to publish every block its tiers hold; answered with Held(0)
    once the events are on the tier socket."""


class Held(msgspec.Struct, tag=True, frozen=True):
    blocks: int


LookupRequest = Lookup | Announce


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[VLLMHash]
    parent_block_hash: VLLMHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[VLLMHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class KVEventTranslator:
    """vLLM's events to Strata's TierEvents for one worker (no I/O: `KVEventRelay` feeds it)."""

    def __init__(self, worker_id: str, block_size: int, salt: BlockHash) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.salt = salt
        self._strata: dict[VLLMHash, BlockHash] = {}  # the blocks vLLM holds, by its hash

    @property
    def num_blocks(self) -> int:
        return len(self._strata)

    def held(self) -> list[BlockHash]:
        """Strata's hashes of the blocks vLLM holds (for an announce)."""
        return list(self._strata.values())

    def translate(self, batch: KVEventBatch) -> list[TierEvent]:
        out: list[TierEvent] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                hashes = self._stored(event)
                kind = "stored"
            elif isinstance(event, BlockRemoved):
                hashes = [self._strata.pop(h) for h in event.block_hashes if h in self._strata]
                kind = "removed"
            else:
                hashes, self._strata = list(self._strata.values()), {}
                kind = "removed"
            if hashes:
                out.append(TierEvent(self.worker_id, kind, G1, tuple(hashes)))  # type: ignore[arg-type]
        return out

    def _stored(self, event: BlockStored) -> list[BlockHash]:
        size = self.block_size
        if event.block_size != size or event.lora_name is not None or event.lora_id is not None:
            return []
        extra = event.extra_keys or [None] * len(event.block_hashes)
        if event.parent_block_hash is None:
            first = extra[0] if extra else None
            if first is not None and not (len(first) == 1 and isinstance(first[0], str)):
                return []  # more than a cache salt in the key
            parent = request_salt(self.salt, first[0] if first else None)
        else:
            known = self._strata.get(event.parent_block_hash)
            if known is None:
                return []
            parent = known
        stored: list[BlockHash] = []
        for i, vllm_hash in enumerate(event.block_hashes):
            if i > 0 and extra[i] is not None:
                break
            parent = hash_block(parent, event.token_ids[i * size : (i + 1) * size])
            self._strata[vllm_hash] = parent
            stored.append(parent)
        return stored


class KVEventRelay:
    """Subscribes to a vLLM engine's KV event socket and publishes its translated events to `sink` (the worker's
    link to the server's index; None: counted, not sent) from a thread of its own. With `tier_endpoint` it also
    binds the socket StrataKVConnector pushes its tier events (G2/G3/G4, msgpack TierEvents) to, and relays them;
    `lookup_endpoint` is the connector's lookup socket, where `announce` asks it to announce its tiers."""

    def __init__(
        self,
        endpoint: str,
        worker_id: str,
        block_size: int,
        salt: BlockHash,
        sink: EventSink | None,
        tier_endpoint: str | None = None,
        lookup_endpoint: str | None = None,
    ):
        self.translator = KVEventTranslator(worker_id, block_size, salt)
        self._sink = sink
        self._lookup_endpoint = lookup_endpoint
        self._context = zmq.Context.instance()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._control_address = f"inproc://strata-kv-control-{id(self)}"
        self._control = self._context.socket(zmq.PULL)  # b"stop" or b"announce", from other threads
        self._control.bind(self._control_address)
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._tiers: zmq.Socket | None = None
        if tier_endpoint is not None:
            self._tiers = self._context.socket(zmq.PULL)
            self._tiers.bind(tier_endpoint)
        self._tier_decoder = msgspec.msgpack.Decoder(TierEvent)
        self._last_seq = -1
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()

    @property
    def num_cached_blocks(self) -> int:
        return self.translator.num_blocks

    def announce(self) -> None:
        """Thread-safe: publish everything the worker holds again, from the relay's thread."""
        self._tell(b"announce")

    def close(self) -> None:
        self._tell(b"stop")
        self._thread.join(5)
        self._control.close(0)

    def _tell(self, command: bytes) -> None:
        with self._context.socket(zmq.PUSH) as push:
            push.connect(self._control_address)
            push.send(command)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._control, zmq.POLLIN)
        if self._tiers is not None:
            poller.register(self._tiers, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._control in ready:
                    if self._control.recv() == b"stop":
                        return
                    self._announce()
                if self._sub in ready:
                    self._receive(self._sub.recv_multipart())
                if self._tiers is not None and self._tiers in ready:
                    self._relay_tier_event(self._tiers.recv())
        finally:
            self._sub.close(0)
            if self._tiers is not None:
                self._tiers.close(0)

    def _announce(self) -> None:
        """G1 (even when empty: it registers the worker with the index), then the connector's tiers."""
        if self._sink is None:
            return
        held = self.translator.held()
        self._sink.publish(TierEvent(self.translator.worker_id, "stored", G1, tuple(held)))
        if self._lookup_endpoint is None:
            return
        with self._context.socket(zmq.REQ) as ask:
            ask.setsockopt(zmq.RCVTIMEO, ANNOUNCE_TIMEOUT_MS)
            ask.setsockopt(zmq.LINGER, 0)
            ask.connect(self._lookup_endpoint)
            ask.send(msgspec.msgpack.encode(Announce()))
            try:
                ask.recv()  # its events are on the tier socket by then
            except zmq.Again:
                logger.warning(
                    "StrataKVConnector did not answer an announce in %d ms; the index may miss tier blocks",
                    ANNOUNCE_TIMEOUT_MS,
                )

    def _relay_tier_event(self, payload: bytes) -> None:
        try:
            event = self._tier_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            logger.warning("tier event from the KV connector not understood (%s); ignored", exc)
            return
        if self._sink is not None:
            self._sink.publish(event)

    def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            logger.warning("vLLM KV event with %d frames ignored", len(frames))
            return
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if self._last_seq >= 0 and seq != self._last_seq + 1:
            logger.warning(
                "vLLM KV events %d..%d were lost; the index misses those blocks", self._last_seq + 1, seq - 1
            )
        self._last_seq = seq
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError as exc:  # a ValidationError too
            logger.warning("vLLM KV event batch not understood (%s); ignored", exc)
            return
        for event in self.translator.translate(batch):
            if self._sink is not None:
                self._sink.publish(event)
