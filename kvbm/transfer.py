"""Moving one request's prompt KV from a prefill engine to a decode engine (disaggregated serving).

    prefill engine (engine thread)                     decode engine
    first token sampled -> KVTransfer.send(...)        submit: KVTransfer.fetch(...) on a fetch thread -> KVSource
      -> (transport, location) inside the typed        admit (engine thread): KVSource.read_into(fresh pool rows),
         KVHandoff the router passes on                  then release (the sender's copy is gone)

Blocks travel block-major, as the pool holds them (kvbm/api.py: one block = `block_bytes` contiguous bytes, all
layers, K then V), and only full blocks: the decode engine recomputes the prompt's last partial block with its
first step, as it would after a prefix-cache hit. A transfer that fails, or a location the receiver cannot
read, costs a recompute, never a wrong token: `read_into` returns how many leading blocks are valid.

Transports (one file each behind `KVTransport`; `KVTransfer` picks one per request by the decode worker's host):
    shm   this file. Same host: the sender writes the blocks to one file in /dev/shm with one gather write
          (os.writev); the receiver maps it, faulted in on its fetch thread, copies each block into its pool row
          on its engine thread and removes the file: two copies, the floor of a cross-process move without
          shared pools.
    tcp   kvbm/transfer_tcp.py. Across hosts: the receiver pulls the blocks from the sender's CURVE-authenticated
          ZMQ socket, one message per request.
A GPU transport (NIXL, CUDA IPC) is another `KVTransport` with the same three calls.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import re
import secrets
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_IOV_MAX = 1024  # buffers per writev call (Linux IOV_MAX)
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault the whole mapping in at mmap time
_PAGE = 4096


class TransferError(RuntimeError):
    """A handoff cannot be read (gone, malformed, another layout); the receiver recomputes the prompt."""


class KVSource(Protocol):
    """A fetched handoff, read on the decode engine's thread."""

    num_blocks: int

    def read_into(self, first: int, rows: Sequence[np.ndarray]) -> int:
        """Copy blocks `first`, `first + 1`, ... into `rows` (each `block_bytes` uint8); return how many leading
        ones are valid."""
        ...

    def release(self) -> None:
        """Done with it (idempotent): the sender's copy may go."""
        ...


class KVTransport(Protocol):
    name: str

    def send(self, block_hashes: Sequence[int], blocks: Sequence[np.ndarray]) -> str:
        """Make these blocks (uint8 rows of the pool, read before this returns) fetchable; return the location."""
        ...

    def fetch(self, location: str, block_hashes: Sequence[int], block_bytes: int) -> KVSource:
        """Open a handoff; raises TransferError if it cannot be read."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """How a worker builds its `KVTransfer` (plain data: it travels into a spawned worker process). With a
    cluster secret it serves cross-host handoffs on `port` (0: any free one), named by `advertise_host`."""

    secret: bytes | None = field(default=None, repr=False)
    bind_host: str = "0.0.0.0"
    advertise_host: str | None = None
    port: int = 0

    def build(self) -> KVTransfer:
        transports: list[KVTransport] = [ShmTransport()]
        if self.secret:
            from kvbm.transfer_tcp import TcpTransport

            transports.append(TcpTransport(self.secret, self.bind_host, self.advertise_host, self.port))
        return KVTransfer(transports)


class KVTransfer:
    """An engine's transports: `send` picks shm when the decode worker runs on this host, else the network
    transport (when this process has one), else none (the decode worker recomputes)."""

    def __init__(self, transports: Sequence[KVTransport] = (), host: str | None = None) -> None:
        self.host = host or socket.gethostname()
        self.transports = {t.name: t for t in transports} or {"shm": ShmTransport()}

    def send(
        self, decode_host: str, block_hashes: Sequence[int], blocks: Sequence[np.ndarray]
    ) -> tuple[str, str]:
        """(transport, location) of the sent blocks; ("none", "") when no transport reaches `decode_host`."""
        name = "shm" if decode_host == self.host and "shm" in self.transports else "tcp"
        transport = self.transports.get(name)
        if transport is None or not blocks:
            return "none", ""
        return name, transport.send(block_hashes, blocks)

    def fetch(self, transport: str, location: str, block_hashes: Sequence[int], block_bytes: int) -> KVSource:
        chosen = self.transports.get(transport)
        if chosen is None:
            raise TransferError(f"no {transport!r} transport in this process")
        return chosen.fetch(location, block_hashes, block_bytes)

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()


# ---- shm ----

_MAGIC = b"STRAKVX1"
_HEADER = struct.Struct(
    "<8sQQ"
)  # magic, num_blocks, block_bytes; then num_blocks u64 hashes; payload page-aligned
_NAME = re.compile(r"strata-kvx-[0-9]+-[0-9a-f]{16}-[0-9]+")


def _payload_offset(num_blocks: int) -> int:
    return -(-(_HEADER.size + 8 * num_blocks) // _PAGE) * _PAGE


class ShmTransport:
    """Same-host handoffs through files in /dev/shm (tmpfs: memory, not disk). Files the receiver never took (its
    request was aborted, its worker died) are removed by the sender after `ttl_s`, and all of them when it closes."""

    name = "shm"

    def __init__(self, directory: Path = SHM_DIR, ttl_s: float = 60.0) -> None:
        self.directory = directory
        self.ttl_s = ttl_s
        self._tag = f"{os.getpid()}-{secrets.token_hex(8)}"
        self._counter = itertools.count()
        self._sent: deque[tuple[float, Path]] = deque()
        self._lock = threading.Lock()

    def send(self, block_hashes: Sequence[int], blocks: Sequence[np.ndarray]) -> str:
        self._sweep(time.monotonic() - self.ttl_s)
        name = f"strata-kvx-{self._tag}-{next(self._counter)}"
        path = self.directory / name
        header = (
            _HEADER.pack(_MAGIC, len(blocks), blocks[0].nbytes)
            + np.asarray(block_hashes, dtype="<u8").tobytes()
        )
        header += bytes(_payload_offset(len(blocks)) - len(header))
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            _write_all(fd, [header, *blocks])
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        with self._lock:
            self._sent.append((time.monotonic(), path))
        return name

    def fetch(self, location: str, block_hashes: Sequence[int], block_bytes: int) -> KVSource:
        if not _NAME.fullmatch(location):
            raise TransferError(f"not a shm handoff name: {location!r:.80}")
        try:
            fd = os.open(self.directory / location, os.O_RDONLY)
        except OSError as err:
            raise TransferError(f"handoff {location}: {err.strerror}") from None
        try:
            head = os.pread(fd, _HEADER.size + 8 * len(block_hashes), 0)
            magic, num_blocks, size = _HEADER.unpack_from(head) if len(head) >= _HEADER.size else (b"", 0, 0)
            hashes = np.frombuffer(head, dtype="<u8", offset=_HEADER.size) if magic == _MAGIC else ()
            if magic != _MAGIC or size != block_bytes or num_blocks != len(block_hashes):
                raise TransferError(f"handoff {location}: another layout or not a handoff")
            if hashes.tolist() != [h & 0xFFFF_FFFF_FFFF_FFFF for h in block_hashes]:
                raise TransferError(f"handoff {location}: holds other blocks")
            return _ShmSource(self.directory / location, fd, num_blocks, block_bytes)
        except TransferError:
            raise
        except (OSError, ValueError) as err:  # e.g. a file shorter than its header says
            raise TransferError(f"handoff {location}: {err}") from None
        finally:
            os.close(fd)  # the mapping keeps the file

    def _sweep(self, older_than: float) -> None:
        with self._lock:
            while self._sent and self._sent[0][0] < older_than:
                self._sent.popleft()[1].unlink(missing_ok=True)  # gone already when its receiver took it

    def close(self) -> None:
        self._sweep(float("inf"))


class _ShmSource:
    """The handoff file mapped and faulted in by `fetch` (on the decode side's fetch thread, MAP_POPULATE), so
    that `read_into`, on the engine thread, is a plain memcpy per block: reading the file there (preadv) would pay
    tmpfs's page lookups on the thread that runs every decode step."""

    def __init__(self, path: Path, fd: int, num_blocks: int, block_bytes: int) -> None:
        self.path, self.num_blocks = path, num_blocks
        offset = _payload_offset(num_blocks)
        if os.fstat(fd).st_size < offset + num_blocks * block_bytes:
            raise TransferError(f"handoff {path.name}: shorter than its {num_blocks} blocks")
        self._map: mmap.mmap | None = mmap.mmap(
            fd, offset + num_blocks * block_bytes, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ
        )
        self._blocks = np.frombuffer(self._map, np.uint8, num_blocks * block_bytes, offset).reshape(
            num_blocks, -1
        )

    def read_into(self, first: int, rows: Sequence[np.ndarray]) -> int:
        if self._map is None:
            return 0
        count = max(0, min(len(rows), self.num_blocks - first))
        for row, block in zip(rows[:count], self._blocks[first : first + count], strict=True):
            np.copyto(row, block)
        return count

    def release(self) -> None:
        if self._map is not None:
            self._blocks = None  # the view's buffer export must go before the mapping can close
            self._map.close()
            self._map = None
            self.path.unlink(missing_ok=True)


def _write_all(fd: int, buffers: list) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
