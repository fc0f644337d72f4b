"""G3: blocks in one preallocated file per layout, block-aligned slots, an index file that survives restarts.

Directory `<disk_path>/<layout tag>/`:

    blocks.dat   num_slots x slot_stride bytes (slot_stride = block_bytes rounded up to 4 KiB), preallocated
    index.dat    4 KiB header (magic, version, block_bytes, num_slots, fingerprint) + num_slots x 32 B records:
                 block hash u64, xxh3_64 checksum of the payload u64, sequence u64 (0 = empty), length u64
    lock         flock held while open: one process owns a disk cache directory at a time

Write order for a put into slot s: (1) clear record s, (2) write the payload, (3) optionally fdatasync,
(4) write record s with the checksum. A torn write (crash between 2 and 4, or a partial page) leaves either an
empty record or a checksum that does not match, and every read verifies the checksum before a block is used:
a mismatch counts as a miss plus `kvbm_checksum_failures{tier="G3"}` and frees the slot. Every put and get
stamps the record with a new sequence number, so the LRU order is rebuilt from the index after a restart.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

from kvbm.block_hash import BlockHash
from kvbm.lru import SlotLRU
from kvbm.metrics import TierMetrics
from kvbm.tier import EvictedBlock, EvictFn, PutResult, layout_tag

log = logging.getLogger(__name__)

MAGIC = 0x334756424B415254  # "TRAKBVG3"
VERSION = 1
PAGE = 4096
RECORD = np.dtype([("hash", "<u8"), ("checksum", "<u8"), ("seq", "<u8"), ("length", "<u8")])


class DiskPoolError(RuntimeError):
    """The disk cache directory cannot be used (owned by another process, other format)."""


class DiskPool:
    """G3 tier (see module docstring). Capacity in blocks is fixed when the files are created."""

    name, level, remote, ttl_s = "G3", 3, False, 0

    def __init__(
        self,
        disk_path: Path,
        fingerprint: str,
        block_bytes: int,
        num_slots: int,
        metrics: TierMetrics | None = None,
        fsync: bool = False,
        on_evict: EvictFn | None = None,
    ) -> None:
        if num_slots < 1:
            raise DiskPoolError(f"G3 at {disk_path} needs at least one slot; raise disk_cache_gb")
        self.dir = Path(disk_path) / layout_tag(fingerprint)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.slot_stride = -(-block_bytes // PAGE) * PAGE
        self._pad = np.empty(self.slot_stride - block_bytes, dtype=np.uint8)  # skipped tail of a slot
        self.metrics = metrics
        self.fsync = fsync
        self.on_evict = on_evict  # told about blocks that leave (LRU victims, corrupt blocks)
        self._lock_fd = os.open(self.dir / "lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            os.close(self._lock_fd)
            raise DiskPoolError(f"G3 directory {self.dir} is in use by another process") from err
        self._index_fd = os.open(self.dir / "index.dat", os.O_CREAT | os.O_RDWR, 0o600)
        self._data_fd = os.open(self.dir / "blocks.dat", os.O_CREAT | os.O_RDWR, 0o600)
        self._open_or_format(fingerprint, num_slots)
        self._lru = SlotLRU()
        self._free: list[int] = []
        self._load_index()

    def _open_or_format(self, fingerprint: str, num_slots: int) -> None:
        header = os.pread(self._index_fd, PAGE, 0)
        fp = fingerprint.encode()[: PAGE - 32]
        if len(header) == PAGE:
            magic, version, block_bytes, slots = np.frombuffer(header[:32], dtype="<u8").tolist()
            stored_fp = header[32:].rstrip(b"\0")
            if (magic, version, block_bytes, stored_fp) == (MAGIC, VERSION, self.block_bytes, fp):
                self.num_slots = slots
                return
            log.warning("G3 index %s has another format or layout; reformatting", self.dir)
        self.num_slots = num_slots
        os.ftruncate(self._index_fd, 0)
        os.ftruncate(self._index_fd, PAGE + num_slots * RECORD.itemsize)
        os.ftruncate(self._data_fd, num_slots * self.slot_stride)
        try:
            os.posix_fallocate(self._data_fd, 0, num_slots * self.slot_stride)
        except OSError as err:
            log.warning("G3 could not preallocate %s: %s", self.dir / "blocks.dat", err)
        head = np.array([MAGIC, VERSION, self.block_bytes, num_slots], dtype="<u8").tobytes()
        os.pwrite(self._index_fd, head + fp.ljust(PAGE - 32, b"\0"), 0)
        os.fsync(self._index_fd)

    def _load_index(self) -> None:
        raw = os.pread(self._index_fd, self.num_slots * RECORD.itemsize, PAGE)
        self._records = np.frombuffer(raw, dtype=RECORD).copy()
        used = np.flatnonzero(self._records["seq"] > 0)
        order = used[np.argsort(self._records["seq"][used], kind="stable")]
        for slot in order.tolist():
            self._lru.insert(BlockHash(int(self._records["hash"][slot])), slot)
        used_set = set(order.tolist())
        self._free = [slot for slot in range(self.num_slots - 1, -1, -1) if slot not in used_set]
        self._seq = int(self._records["seq"].max(initial=0)) + 1
        if used.size:
            log.info("G3 %s: recovered %d blocks", self.dir, used.size)

    @property
    def capacity_blocks(self) -> int:
        return self.num_slots

    @property
    def used_blocks(self) -> int:
        return len(self._lru)

    def contains(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        return [block_hash in self._lru for block_hash in block_hashes]

    def _write_record(self, slot: int, block_hash: int, checksum: int, seq: int) -> None:
        record = self._records[slot]
        record["hash"], record["checksum"], record["seq"], record["length"] = (
            block_hash,
            checksum,
            seq,
            self.block_bytes,
        )
        os.pwrite(self._index_fd, self._records[slot : slot + 1].tobytes(), PAGE + slot * RECORD.itemsize)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        victim = self._lru.pop_lru()
        if victim is None:
            return None
        self._write_record(victim[1], 0, 0, 0)
        if self.on_evict is not None:
            self.on_evict([EvictedBlock(victim[0])])
        return victim[1]

    def put(self, block_hashes: Sequence[BlockHash], blocks: Sequence[np.ndarray]) -> PutResult:
        """A block that finds no slot (every one pinned) or fails to write rejects itself and the rest."""
        result = PutResult()
        for index, (block_hash, block) in enumerate(zip(block_hashes, blocks, strict=True)):
            if block_hash in self._lru:
                self._lru.touch(block_hash)
            elif self._store(block_hash, block):
                result.stored.append(block_hash)
            else:
                result.rejected = list(range(index, len(block_hashes)))
                break
        return result

    def _store(self, block_hash: BlockHash, block: np.ndarray) -> bool:
        slot = self._take_slot()
        if slot is None:
            return False
        try:
            os.pwrite(self._data_fd, block, slot * self.slot_stride)
            if self.fsync:
                os.fdatasync(self._data_fd)
            self._write_record(slot, block_hash, xxhash.xxh3_64_intdigest(block), self._seq)
        except (
            OSError
        ) as err:  # disk full, I/O error: the slot's record stays cleared, so nothing torn is served
            log.warning("G3 write to %s failed: %s", self.dir, err)
            self._free.append(slot)
            return False
        self._seq += 1
        self._lru.insert(block_hash, slot)
        return True

    def get(self, block_hashes: Sequence[BlockHash], dests: Sequence[np.ndarray]) -> list[bool]:
        """Read runs of consecutive slots with one preadv each straight into `dests`, then verify checksums."""
        wanted = [
            (slot, index) for index, h in enumerate(block_hashes) if (slot := self._lru.slot(h)) is not None
        ]
        for _, index in wanted:
            self._lru.pin(block_hashes[index])
        try:
            self._read_runs(sorted(wanted), dests)
        finally:
            for _, index in wanted:
                self._lru.unpin(block_hashes[index])
        valid = [False] * len(block_hashes)
        for slot, index in wanted:
            if xxhash.xxh3_64_intdigest(dests[index]) == int(self._records["checksum"][slot]):
                valid[index] = True
                self._touch(block_hashes[index], slot)
            else:
                self._drop_corrupt(block_hashes[index], slot)
        return valid

    def _touch(self, block_hash: BlockHash, slot: int) -> None:
        """Most recently used now, in memory and in the record's sequence number (so LRU order survives restart)."""
        self._lru.touch(block_hash)
        record = self._records[slot]
        self._write_record(slot, int(record["hash"]), int(record["checksum"]), self._seq)
        self._seq += 1

    def _read_runs(self, wanted: list[tuple[int, int]], dests: Sequence[np.ndarray]) -> None:
        run: list[tuple[int, int]] = []
        for slot, index in wanted:
            if run and (slot != run[-1][0] + 1 or len(run) >= 256):
                self._read_run(run, dests)
                run = []
            run.append((slot, index))
        if run:
            self._read_run(run, dests)

    def _read_run(self, run: list[tuple[int, int]], dests: Sequence[np.ndarray]) -> None:
        buffers: list[np.ndarray] = []
        for _, index in run:
            buffers += [dests[index], self._pad] if self._pad.size else [dests[index]]
        expected = self.slot_stride * len(run) - (self.slot_stride - self.block_bytes)
        buffers = buffers[:-1] if self._pad.size else buffers
        got = os.preadv(self._data_fd, buffers, run[0][0] * self.slot_stride)
        if got != expected:
            log.warning("G3 short read in %s: %d of %d bytes", self.dir, got, expected)

    def _drop_corrupt(self, block_hash: BlockHash, slot: int) -> None:
        log.warning("G3 checksum mismatch for block %016x in slot %d; dropping it", block_hash, slot)
        if self.metrics is not None:
            self.metrics.record_checksum_failure(self.name)
        self._lru.remove(block_hash)
        self._write_record(slot, 0, 0, 0)
        self._free.append(slot)
        if self.on_evict is not None:
            self.on_evict([EvictedBlock(block_hash)])

    def evict(self, num_blocks: int) -> list[BlockHash]:
        evicted: list[BlockHash] = []
        while len(evicted) < num_blocks and (victim := self._lru.pop_lru()) is not None:
            self._write_record(victim[1], 0, 0, 0)
            self._free.append(victim[1])
            evicted.append(victim[0])
        return evicted

    def hashes(self) -> list[BlockHash]:
        """Every block held, least recently used first."""
        return self._lru.hashes()

    def owned_hashes(self, owner: str) -> list[BlockHash]:
        """Every block: a disk cache directory belongs to one worker."""
        return self.hashes()

    def close(self) -> None:
        if self._lock_fd < 0:
            return
        os.fsync(self._index_fd)
        for fd in (self._data_fd, self._index_fd, self._lock_fd):
            os.close(fd)
        self._lock_fd = -1
