"""The typed messages between a sharded worker's driver (rank 0) and its other ranks, on local ZMQ sockets.

    driver -> each rank (a PUSH per rank, in order)     Step, Lookup, Onboard, Offload, Stop
    each rank -> driver (one PULL)     Ready, LoadFailed, Beat, Answer

Tensors travel as raw little-endian bytes with their dtype and shape: a step's inputs are int64 and bool index
tensors of a few KiB; no message carries code (msgspec, no pickle). Hidden states and logits go over the group's
collectives (comm.py), not here.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from server.engine.model import DecodeGroup, PrefillChunk, StepBatch

_DTYPES = {"int64": torch.int64, "bool": torch.bool}


class WireTensor(msgspec.Struct, array_like=True):
    dtype: str  # a key of _DTYPES
    shape: list[int]
    data: bytearray  # writable, so the tensor is a view of it


class WireGroup(msgspec.Struct, array_like=True):
    start: int
    count: int
    block_tables: WireTensor
    mask: WireTensor | None
    lengths: WireTensor | None


class WirePrefill(msgspec.Struct, array_like=True):
    start: int
    length: int
    context_len: int
    block_table: WireTensor
    mask: WireTensor | None


class WireBatch(msgspec.Struct, array_like=True):
    token_ids: WireTensor
    positions: WireTensor
    slot_blocks: WireTensor
    slot_offsets: WireTensor
    num_decode: int
    decode_groups: list[WireGroup]
    prefills: list[WirePrefill]
    logits_rows: WireTensor


class Step(msgspec.Struct, tag=True, array_like=True):
    """Compute these micro-batches (one per pipeline slot, in order). `traces`: (traceparent, tokens) of each
    prompt chunk in it whose request is traced (server/tracing.py): the rank records its part of the step for it."""

    batches: list[WireBatch]
    traces: list[tuple[str, int]] = []


class Lookup(msgspec.Struct, tag=True, array_like=True):
    """How many leading blocks of `block_hashes` this rank's tiers hold (answered)."""

    call_id: int
    block_hashes: list[int]


class Onboard(msgspec.Struct, tag=True, array_like=True):
    """Load these blocks' parts into these pool rows (answered with how many leading blocks are valid)."""

    call_id: int
    block_hashes: list[int]
    block_ids: list[int]


class Offload(msgspec.Struct, tag=True, array_like=True):
    """Copy these rows' parts out to the tiers (answered once they are there: a handoff through the tiers names
    blocks the decode worker must find)."""

    call_id: int
    block_hashes: list[int]
    block_ids: list[int]


class Stop(msgspec.Struct, tag=True, array_like=True):
    """Close the tiers and exit."""


ToRank = Step | Lookup | Onboard | Offload | Stop
Question = Lookup | Onboard | Offload  # answered by every rank


class Ready(msgspec.Struct, tag=True, array_like=True):
    """Weights loaded and pool allocated; the rank joins the group's collectives next."""

    rank: int
    pid: int


class LoadFailed(msgspec.Struct, tag=True, array_like=True):
    rank: int
    error: str


class Beat(msgspec.Struct, tag=True, array_like=True):
    """Alive; its resident memory in bytes, and its seconds spent computing steps so far."""

    rank: int
    rss_bytes: int
    busy_s: float


class Answer(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    rank: int
    value: int


FromRank = Ready | LoadFailed | Beat | Answer


def encode_tensor(tensor: torch.Tensor) -> WireTensor:
    array = tensor.cpu().numpy()
    return WireTensor(str(array.dtype), list(array.shape), bytearray(array.tobytes()))


def decode_tensor(wire: WireTensor, device: torch.device) -> torch.Tensor:
    if wire.dtype not in _DTYPES:
        raise ValueError(f"tensor dtype {wire.dtype!r} is not a step input's")
    array = np.frombuffer(wire.data, dtype=np.dtype(wire.dtype)).reshape(wire.shape)
    return torch.from_numpy(array).to(device)


def _maybe(tensor: torch.Tensor | None) -> WireTensor | None:
    return None if tensor is None else encode_tensor(tensor)


def _maybe_decode(wire: WireTensor | None, device: torch.device) -> torch.Tensor | None:
    return None if wire is None else decode_tensor(wire, device)


def encode_batch(batch: StepBatch) -> WireBatch:
    return WireBatch(
        token_ids=encode_tensor(batch.token_ids),
        positions=encode_tensor(batch.positions),
        slot_blocks=encode_tensor(batch.slot_blocks),
        slot_offsets=encode_tensor(batch.slot_offsets),
        num_decode=batch.num_decode,
        decode_groups=[
            WireGroup(g.start, g.count, encode_tensor(g.block_tables), _maybe(g.mask), _maybe(g.lengths))
            for g in batch.decode_groups
        ],
        prefills=[
            WirePrefill(p.start, p.length, p.context_len, encode_tensor(p.block_table), _maybe(p.mask))
            for p in batch.prefills
        ],
        logits_rows=encode_tensor(batch.logits_rows),
    )


def decode_batch(wire: WireBatch, device: torch.device) -> StepBatch:
    """The step batch on `device` (on the CPU its tensors are views of the message)."""
    return StepBatch(
        token_ids=decode_tensor(wire.token_ids, device),
        positions=decode_tensor(wire.positions, device),
        slot_blocks=decode_tensor(wire.slot_blocks, device),
        slot_offsets=decode_tensor(wire.slot_offsets, device),
        num_decode=wire.num_decode,
        decode_groups=[
            DecodeGroup(
                g.start,
                g.count,
                decode_tensor(g.block_tables, device),
                _maybe_decode(g.mask, device),
                _maybe_decode(g.lengths, device),
            )  # fmt: skip
            for g in wire.decode_groups
        ],
        prefills=[
            PrefillChunk(
                p.start,
                p.length,
                p.context_len,
                decode_tensor(p.block_table, device),
                _maybe_decode(p.mask, device),
            )
            for p in wire.prefills
        ],
        logits_rows=decode_tensor(wire.logits_rows, device),
    )
