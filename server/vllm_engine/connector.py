"""`StrataKVConnector`: vLLM's KV-transfer connector (KVConnectorBase_V1) over Strata's KV tiers (G2 host shm, G3
disk, G4 Redis), as LMCache and Dynamo's KVBM plug into vLLM.

vLLM builds the connector twice, in two processes of one engine:

    scheduler half (engine core process)              worker half (vLLM's worker process, owns the KV cache)
      get_num_new_matched_tokens: the prompt's  --lookup (ipc REQ/REP)-->  KVBMConnector.lookup: leading blocks
        full blocks beyond the local prefix hit                              some tier holds
      update_state_after_alloc: a load plan               metadata      start_load_kv (before the forward, vLLM
      build_connector_meta: this step's loads  ---- (each step) ---->      runs sync loads first): tiers -> staging
        and the blocks this step completes                                 -> the request's vLLM blocks
                                                                         wait_for_save (after the forward): vLLM
                                                                           blocks -> staging -> G2 (or G3, G4)

Offload is write-through: each full block is copied out in the step that completes it (prompt chunks and decoded
tokens alike), while its request still holds it. vLLM tells a connector nothing when it evicts a cached block, so
this is how an evicted block is already in the tiers when a later prompt needs it. A block the tiers fail to deliver
(evicted or corrupt since the lookup) is reported to vLLM, which recomputes it (kv_load_failure_policy "recompute").

Blocks are keyed by Strata's chained hashes (`kvbm.block_hash`, with the request's cache_salt) from the same model
salt as `VLLMEngine.block_layout`, so the router's index, the G1 events of `kv_events.py` and these tiers agree.

vLLM's CPU backend keeps one tensor per layer, [num_blocks, num_kv_heads, block_size, 2 x head_size]; a block is
one slice of each. The tiers store a block as one contiguous row, all layers in order, so transfers go through a
staging buffer of `staging_blocks` rows (one gather or scatter per layer per block). The tiers' own logic (G2 sharing
on the node, spill to G3, G4 write-through, flush on close, tier events) is `kvbm/connector.py`'s, unchanged; its
events reach the Strata worker over an ipc PUSH socket and from there the server's index.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvbm.agent import build_connector
from kvbm.api import KVLayout
from kvbm.block_hash import BlockHash, hash_block, model_salt, request_salt
from kvbm.config import KVBMConfig
from kvbm.connector import KVBMConnector
from kvbm.events import TierEvent
from server.vllm_engine.kv_events import Announce, Held, Lookup, LookupRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

BLOCK_KEY_ENV = (
    "STRATA_KVBM_BLOCK_KEY"  # hex; set by VLLMEngine for its engine's processes, never in a config vLLM logs
)
OLD_BLOCK_KEY_ENV = "STRATA_KVBM_G4_KEY"  # its former name, still read when BLOCK_KEY_ENV is unset
LOOKUP_TIMEOUT_MS = 5000
LOOKUP_BACKOFF_S = 30.0


def engine_fingerprint(vllm_config: VllmConfig) -> str:
    """What keys a vLLM engine's blocks: the model folder, dtype and block size (the root of its hash chains)."""
    model = vllm_config.model_config
    dtype = str(model.dtype).removeprefix("torch.")
    return f"vllm|{Path(str(model.model)).name}|{dtype}|bs{vllm_config.cache_config.block_size}"


class ConnectorSettings(msgspec.Struct, frozen=True):
    """`kv_connector_extra_config` of a Strata-managed engine (JSON values; the block key travels in
    BLOCK_KEY_ENV)."""

    kvbm: dict[str, Any]  # KVBMConfig.to_json() without the block key
    worker_id: str
    lookup: str  # ipc endpoint the worker half answers lookups on
    events: str | None = None  # ipc endpoint of the Strata worker's tier-event relay (None: Redis or nowhere)
    staging_blocks: int = 16

    def kvbm_config(self) -> KVBMConfig:
        key = os.environ.get(BLOCK_KEY_ENV) or os.environ.get(OLD_BLOCK_KEY_ENV)
        return KVBMConfig.from_json({**self.kvbm, "block_key": key})


@dataclass(slots=True)
class BlockTransfer:
    """Blocks of one request to move between vLLM's pool (`block_ids`) and the tiers (`block_hashes`)."""

    request_id: str
    block_hashes: list[BlockHash]
    block_ids: list[int]


@dataclass
class StrataConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker half: loads run before the forward, saves after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


class StrataKVConnector(KVConnectorBase_V1):
    """The connector vLLM instantiates per role; each role's work is its half's."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        settings = msgspec.convert(extra.get("strata"), ConnectorSettings)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerHalf(vllm_config, settings)
        else:
            self._worker = _WorkerHalf(vllm_config, kv_cache_config, settings)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save a preemption cuts short is a future miss, not a lost hand-off."""
        return False

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self._scheduler.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._kv_cache_manager is not None, "vLLM binds the KV cache manager before scheduling"
        return self._scheduler.step(scheduler_output, self._kv_cache_manager)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request.request_id)
        return False, None

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.load(self._get_connector_metadata().loads)  # type: ignore[attr-defined]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saved whole blocks after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        self._worker.save(self._get_connector_metadata().saves)  # type: ignore[attr-defined]

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self._worker.close()
        else:
            self._scheduler.close()


@dataclass(slots=True)
class _Tracked:
    """A request the scheduler half follows: its hash chain so far and how many leading blocks are in the tiers
    (saved by it or loaded from them)."""

    request: Request
    root: BlockHash
    block_hashes: list[BlockHash] = field(default_factory=list)
    saved_blocks: int = 0
    first_new_block: int = 0  # the first block past the local prefix hit at the last lookup

    def hashes(self, num_blocks: int, block_size: int) -> list[BlockHash]:
        """The chain's first `num_blocks` hashes, extended from the request's tokens as it grows."""
        tokens = self.request.all_token_ids
        parent = self.block_hashes[-1] if self.block_hashes else self.root
        for i in range(len(self.block_hashes), num_blocks):
            parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size])
            self.block_hashes.append(parent)
        return self.block_hashes[:num_blocks]


class _SchedulerHalf:
    def __init__(self, vllm_config: VllmConfig, settings: ConnectorSettings) -> None:
        self.block_size = int(vllm_config.cache_config.block_size)
        self.salt = model_salt(engine_fingerprint(vllm_config))
        self._lookup = _LookupClient(settings.lookup)
        self._requests: dict[str, _Tracked] = {}
        self._loads: list[BlockTransfer] = []

    def _tracked(self, request: Request) -> _Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            root = request_salt(self.salt, request.cache_salt)
            tracked = self._requests[request.request_id] = _Tracked(request, root)
        return tracked

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past the local hit that the tiers can deliver: whole blocks, leaving the last token to compute
        (vLLM needs one to sample from)."""
        tracked = self._tracked(request)
        first = tracked.first_new_block = num_computed_tokens // self.block_size
        usable = (request.num_tokens - 1) // self.block_size
        if usable <= first:
            return 0
        found = self._lookup.query(tracked.hashes(usable, self.block_size)[first:])
        return found * self.block_size

    def allocated(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        tracked = self._tracked(request)
        first, count = tracked.first_new_block, num_external_tokens // self.block_size
        if count:
            hashes = tracked.hashes(first + count, self.block_size)[first:]
            self._loads.append(BlockTransfer(request.request_id, hashes, block_ids[first : first + count]))
        tracked.saved_blocks = max(tracked.saved_blocks, first + count)

    def step(self, scheduler_output: SchedulerOutput, kv_cache_manager: Any) -> StrataConnectorMetadata:
        """The loads planned since the last step, and every block this step's forward completes."""
        saves = []
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            tracked = self._requests.get(request_id)
            if tracked is None:
                continue
            request = tracked.request
            computed = min(request.num_computed_tokens + num_tokens, len(request.all_token_ids))
            full = computed // self.block_size
            if full > tracked.saved_blocks:
                block_ids = kv_cache_manager.get_block_ids(request_id)[0]
                hashes = tracked.hashes(full, self.block_size)
                first = tracked.saved_blocks
                saves.append(BlockTransfer(request_id, hashes[first:full], list(block_ids[first:full])))
                tracked.saved_blocks = full
        metadata = StrataConnectorMetadata(self._loads, saves)
        self._loads = []
        return metadata

    def finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def close(self) -> None:
        self._lookup.close()


class _WorkerHalf:
    """Owns the KVBM agent of this engine; the main thread (loads, saves) and the lookup thread share it under one
    lock."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings):
        self.settings = settings
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.fingerprint = engine_fingerprint(vllm_config)
        self._lock = threading.Lock()
        self._load_errors: set[int] = set()
        self._layers: list[torch.Tensor] = []  # [num_blocks, ...] view of each layer, in the model's order
        self.agent: KVBMConnector | None = None
        self._lookup: _LookupServer | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = [_block_major(name, kv, self.num_blocks) for name, kv in kv_caches.items()]
        first = self._layers[0]
        per_layer = first[0].numel()
        spec = self.spec
        layout = KVLayout(
            f"{self.fingerprint}|{first.dtype}|{'x'.join(map(str, first.shape[1:]))}",
            len(self._layers), spec.block_size, spec.num_kv_heads, spec.head_size, first.dtype,
        )  # fmt: skip
        if layout.block_bytes != len(self._layers) * per_layer * first.element_size():
            raise ValueError(
                f"StrataKVConnector: vLLM's per-layer KV block ({tuple(first.shape[1:])}) is not K and V of "
                f"{spec.num_kv_heads} heads x {spec.block_size} tokens x {spec.head_size}; this layout is not supported"
            )
        self.staging = torch.empty(
            (self.settings.staging_blocks, len(self._layers), per_layer), dtype=first.dtype
        )
        sink = _EventPush(self.settings.events) if self.settings.events else None
        self.agent = build_connector(self.settings.kvbm_config(), self.settings.worker_id, index=sink)
        self.agent.bind(self.staging, layout)
        self._lookup = _LookupServer(self.settings.lookup, self._count_held, self._announce)
        logger.info(
            "StrataKVConnector %s: %d layers, %d-byte blocks, tiers %s",
            self.settings.worker_id, len(self._layers), layout.block_bytes, [t.name for t in self.agent.tiers],
        )  # fmt: skip

    def _count_held(self, block_hashes: list[BlockHash]) -> int:
        assert self.agent is not None
        with self._lock:
            return self.agent.lookup(block_hashes)

    def _announce(self) -> None:
        assert self.agent is not None
        with self._lock:
            self.agent.announce()

    def load(self, transfers: list[BlockTransfer]) -> None:
        """Onboard each request's planned blocks into vLLM's rows; a request's blocks from its first miss on are
        load errors (vLLM recomputes from there, so nothing after it is fetched)."""
        for transfer in transfers:
            for start, hashes, block_ids in self._batches(transfer):
                with self._lock:
                    assert self.agent is not None
                    valid = self.agent.onboard(hashes, range(len(hashes)))
                for row, block_id in enumerate(block_ids[:valid]):
                    for layer, kv in enumerate(self._layers):
                        kv[block_id].copy_(self.staging[row, layer].view(kv.shape[1:]))
                if valid < len(hashes):
                    self._load_errors.update(transfer.block_ids[start + valid :])
                    break

    def save(self, transfers: list[BlockTransfer]) -> None:
        for transfer in transfers:
            for _, hashes, block_ids in self._batches(transfer):
                for row, block_id in enumerate(block_ids):
                    for layer, kv in enumerate(self._layers):
                        self.staging[row, layer].view(kv.shape[1:]).copy_(kv[block_id])
                with self._lock:
                    assert self.agent is not None
                    self.agent.offload(hashes, range(len(hashes)))

    def _batches(self, transfer: BlockTransfer):
        """(offset, hashes, block ids) of `transfer` in runs of at most `staging_blocks`."""
        size = self.settings.staging_blocks
        for start in range(0, len(transfer.block_ids), size):
            yield start, transfer.block_hashes[start : start + size], transfer.block_ids[start : start + size]

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        if errors:
            logger.warning("StrataKVConnector: %d blocks failed to load; vLLM recomputes them", len(errors))
        return errors

    def close(self) -> None:
        if self._lookup is not None:
            self._lookup.close()
        if self.agent is not None:
            with self._lock:
                self.agent.close()


def _block_major(name: str, kv: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """`kv` viewed with its block dimension first (vLLM's CPU layout has it first already)."""
    for dim, size in enumerate(kv.shape):
        if size == num_blocks:
            return kv.movedim(dim, 0)
    raise ValueError(
        f"StrataKVConnector: {name}: no dimension of {tuple(kv.shape)} is the {num_blocks} blocks"
    )


class _EventPush:
    """The worker half's EventSink: tier events to the Strata worker process, msgpack over ipc PUSH."""

    def __init__(self, endpoint: str) -> None:
        self._socket = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(endpoint)
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, event: TierEvent) -> None:
        try:
            self._socket.send(self._encoder.encode(event), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("tier event dropped: the Strata worker is not reading them")

    def close(self) -> None:
        self._socket.close()


class _LookupServer:
    """Answers the scheduler half's Lookups with the count of leading blocks held, from a thread of the worker
    process; an Announce (from the Strata worker's relay) announces the tiers' blocks and is answered with 0."""

    def __init__(self, endpoint: str, count_held, announce) -> None:
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.REP)
        self._socket.bind(endpoint)
        self._endpoint = endpoint
        self._count_held = count_held
        self._announce = announce
        self._stop = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(LookupRequest)
        self._thread = threading.Thread(target=self._run, name="strata-kv-lookup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            try:
                request = self._decoder.decode(self._socket.recv())
                if isinstance(request, Announce):
                    self._announce()
                    held = 0
                else:
                    held = self._count_held(request.block_hashes)
            except Exception:  # the thread must answer every request, or the scheduler waits out each lookup
                logger.exception("StrataKVConnector lookup failed; answered as a miss")
                held = 0
            self._socket.send(msgspec.msgpack.encode(Held(held)))
        self._socket.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        if self._endpoint.startswith("ipc://"):
            Path(self._endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


class _LookupClient:
    """The scheduler half's end: a miss (0) when the worker half does not answer in time, and for the next
    LOOKUP_BACKOFF_S after that (so a stuck worker half costs one timeout, not one per request)."""

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._retry_at = 0.0  # time.monotonic()

    def query(self, block_hashes: list[BlockHash]) -> int:
        if time.monotonic() < self._retry_at:
            return 0
        if self._socket is None:
            self._socket = self._context.socket(zmq.REQ)
            self._socket.setsockopt(zmq.RCVTIMEO, LOOKUP_TIMEOUT_MS)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self._endpoint)
        try:
            self._socket.send(msgspec.msgpack.encode(Lookup(block_hashes)))
            return msgspec.msgpack.decode(self._socket.recv(), type=Held).blocks
        except zmq.Again:
            logger.warning(
                "StrataKVConnector: no lookup answer in %d ms; counted as a miss", LOOKUP_TIMEOUT_MS
            )
            self._socket.close(0)
            self._socket = None  # a REQ socket that missed its reply cannot send again
            self._retry_at = time.monotonic() + LOOKUP_BACKOFF_S
            return 0

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
