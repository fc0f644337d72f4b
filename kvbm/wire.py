"""The KVBM service's query protocol over TCP (one persistent connection per client, requests in order).

request   u32 little-endian block count n, then n x u64 little-endian block hashes
response  u32 little-endian length m, then m bytes of JSON: PrefixReport.to_dict()
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Sequence

import numpy as np

from kvbm.block_hash import BlockHash
from kvbm.index import PrefixReport

MAX_QUERY_BLOCKS = 1 << 20
_U32 = struct.Struct("<I")


def recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, remaining = [], size
    while remaining:
        chunk = sock.recv(remaining)
        if not chunk:
            raise ConnectionError("kvbm service connection closed")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def encode_query(block_hashes: Sequence[BlockHash]) -> bytes:
    return _U32.pack(len(block_hashes)) + np.array(block_hashes, dtype="<u8").tobytes()


def read_query(sock: socket.socket) -> list[BlockHash]:
    (count,) = _U32.unpack(recv_exact(sock, 4))
    if count > MAX_QUERY_BLOCKS:
        raise ValueError(f"query of {count} blocks exceeds {MAX_QUERY_BLOCKS}")
    return np.frombuffer(recv_exact(sock, 8 * count), dtype="<u8").tolist()


def encode_report(report: PrefixReport, events_applied: int) -> bytes:
    body = json.dumps({**report.to_dict(), "events_applied": events_applied}, separators=(",", ":")).encode()
    return _U32.pack(len(body)) + body


def read_report(sock: socket.socket) -> tuple[PrefixReport, int]:
    """(the report, how many events the service's index had applied when it answered)."""
    (size,) = _U32.unpack(recv_exact(sock, 4))
    raw = json.loads(recv_exact(sock, size))
    return PrefixReport.from_dict(raw), int(raw.get("events_applied", 0))
