"""G2: a block pool in POSIX shared memory that every worker process on the node maps.

Segment `/dev/shm/strata-kvbm-<cache_id>-<layout tag>` (a file in /dev/shm so it can carry an fcntl lock):

    +---------------------+ 0
    | segment header      |  magic, version, block_bytes, num_slots, ways, clock, slot_stride, data_offset
    +---------------------+ 4096
    | slot headers        |  num_slots x 64 B: hash, last_use, state, pins, uses, writer pid, owner[32]
    +---------------------+ data_offset (4 KiB aligned)
    | slot 0 payload      |  block_bytes, padded to slot_stride (4 KiB multiple)
    | slot 1 payload      |
    | ...                 |
    +---------------------+

The slot headers *are* the cross-process index: the pool is set-associative (as CPU caches are), with two choices.
Block hash h may live only in set `h % num_sets` or set `(h >> 32) % num_sets`, i.e. one of 2 x `ways` (16)
slots, so a lookup reads 32 headers and no separate hash table can go stale; a put takes a free slot of either
set, else the least recently used idle slot of the two (the clock in the segment header orders uses). With one
set per hash, a set overflows well before the pool is full and evicts a block from the middle of a cached prefix,
which cuts every later block of that prefix off; two choices keep the most loaded set near the mean. Every
header access holds `flock` on the segment file plus a thread lock; payload copies run without the lock:

    put: lock, claim slot (state WRITING, hash = new), unlock, spill the old payload, copy in, lock, READY, unlock
    get: lock, pins += 1, unlock, copy out, lock, pins -= 1, unlock   (`pinned`: the same around any reader)

Invariants: a reader sees only READY slots; a slot with pins > 0 or state WRITING is never chosen as a victim
(a WRITING slot whose writer pid has died is reclaimed; a pin left by a process killed mid-copy keeps its one
slot until a process opens the segment while no other maps it, which clears every pin and WRITING slot).

Users and lifetime: every process that maps the segment holds a shared OFD lock (fcntl F_OFD_SETLK: held per
open file, dropped by the kernel when the process dies, even by kill -9) on byte 0 of the file; flock, which
guards the headers, is a separate lock. A process that can take that byte exclusively is the only user. A pool
opened that way clears stale pins and WRITING slots (what kill -9 left); a pool closing that way (`leave`) is
the last user and removes the segment unless the operator keeps it (the connector decides, see connector.py).
A segment left by kill -9 is therefore found and reused by the next start, and removed by its next graceful
stop. On CUDA this segment would be registered as pinned host memory (cudaHostRegister) so G2<->G1 copies run
as DMA; here G1 is host memory too and a copy is a memcpy.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvbm.block_hash import BlockHash
from kvbm.tier import EvictedBlock, EvictFn, PutResult, copy_blocks, layout_tag

log = logging.getLogger(__name__)

MAGIC = 0x4D42564B41525453  # "STRAKVBM"
VERSION = 1
PAGE = 4096
SHM_DIR = Path("/dev/shm")  # a file there can carry an fcntl lock
EMPTY, WRITING, READY = 0, 1, 2
# slot `pid`: the writer while WRITING; once READY, 0 after its owner flushed it to G3 on close (mark_flushed)
SLOT_HEADER = np.dtype(
    [
        ("hash", "<u8"),
        ("last_use", "<u8"),
        ("state", "<u4"),
        ("pins", "<u4"),
        ("uses", "<u4"),
        ("pid", "<u4"),
        ("owner", "S32"),
    ]
)
_META_FIELDS = ("magic", "version", "block_bytes", "num_slots", "ways", "clock", "slot_stride", "data_offset")
CLOCK = _META_FIELDS.index("clock")  # LRU clock: bumped by every use, under the lock


def segment_path(shm_dir: Path, cache_id: str, fingerprint: str) -> Path:
    return Path(shm_dir) / f"strata-kvbm-{cache_id}-{layout_tag(fingerprint)}"


def remove_segments(cache_id: str, shm_dir: Path = SHM_DIR) -> None:
    """Delete every segment named `cache_id` (any layout). Segments outlive their processes by design, so that a
    restarted node finds its blocks; a throwaway cache (a test, a benchmark run) is removed with this."""
    for path in Path(shm_dir).glob(f"strata-kvbm-{cache_id}-*"):
        path.unlink(missing_ok=True)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _lock_users(fd: int, kind: int, wait: bool = False) -> bool:
    """Set this open file's OFD lock on byte 0 (F_RDLCK: one more user, F_WRLCK: the only user, F_UNLCK:
    none). Without `wait`, False if another open file holds a conflicting lock."""
    request = struct.pack("@hhqqi4x", kind, os.SEEK_SET, 0, 1, 0)  # struct flock; an OFD lock needs l_pid 0
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, request)
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: held by another open file
        return False
    return True


def _same_file(fd: int, path: Path) -> bool:
    """Is `fd` still the file at `path` (not unlinked by the last user while we waited for its lock)?"""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


class HostPool:
    """G2 tier, a `NodeShared` one (see module docstring). `on_evict` gets the blocks a put evicts, before they are overwritten."""

    name, level, remote, ttl_s = "G2", 2, False, 0

    def __init__(
        self,
        cache_id: str,
        fingerprint: str,
        block_bytes: int,
        num_slots: int,
        owner: str = "",
        on_evict: EvictFn | None = None,
        shm_dir: Path = SHM_DIR,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"G2 host pool needs at least one slot (got {num_slots}); raise host_cache_gb")
        self.path = segment_path(shm_dir, cache_id, fingerprint)
        self.segment = self.path.name  # the workers of this host that map it share its blocks
        self.block_bytes = block_bytes
        self.on_evict = on_evict
        self._owner = owner.encode()[:32]
        self._pid = os.getpid()
        self._thread_lock = threading.Lock()
        self._fd, alone = self._open_as_user()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if os.fstat(self._fd).st_size == 0 or os.pread(self._fd, 8, 0) != MAGIC.to_bytes(8, "little"):
                self._format(block_bytes, num_slots)  # new, or its creator died before writing the header
            self._map()
            if alone:
                self._clear_stale()
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        if alone:
            _lock_users(self._fd, fcntl.F_RDLCK)  # downgrade: other processes may map it now

    def _open_as_user(self) -> tuple[int, bool]:
        """Open the segment file holding its users lock: exclusive (True) if no other process maps it, else
        shared. A file unlinked by its last user while we waited for the lock is dropped for a fresh one."""
        while True:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
            alone = _lock_users(fd, fcntl.F_WRLCK)
            if not alone:
                _lock_users(fd, fcntl.F_RDLCK, wait=True)
            if _same_file(fd, self.path):
                return fd, alone
            os.close(fd)

    def _clear_stale(self) -> None:
        """No other process maps the segment: every pin and WRITING slot was left by a process that died
        mid-copy (caller holds the lock)."""
        pinned = int(np.count_nonzero(self._slots["pins"]))
        writing = np.flatnonzero(self._slots["state"] == WRITING)
        if pinned or writing.size:
            log.info(
                "G2 segment %s: cleared %d stale pins, %d unfinished writes", self.path, pinned, writing.size
            )
        self._slots["pins"] = 0
        self._slots["state"][writing] = EMPTY

    def _format(self, block_bytes: int, num_slots: int) -> None:
        ways = min(16, num_slots)
        num_slots -= num_slots % ways
        slot_stride = _round_up(block_bytes, PAGE)
        data_offset = _round_up(PAGE + num_slots * SLOT_HEADER.itemsize, PAGE)
        os.ftruncate(self._fd, data_offset + num_slots * slot_stride)
        values = (MAGIC, VERSION, block_bytes, num_slots, ways, 1, slot_stride, data_offset)
        os.pwrite(self._fd, np.array(values, dtype="<u8").tobytes(), 0)
        log.info("created G2 segment %s: %d slots of %d bytes", self.path, num_slots, block_bytes)

    def _map(self) -> None:
        head = np.frombuffer(os.pread(self._fd, 8 * len(_META_FIELDS), 0), dtype="<u8")
        meta = dict(zip(_META_FIELDS, (int(v) for v in head), strict=True))
        if meta["magic"] != MAGIC or meta["version"] != VERSION or meta["block_bytes"] != self.block_bytes:
            raise ValueError(
                f"G2 segment {self.path} has another format or block size; remove it to reformat"
            )
        size = meta["data_offset"] + meta["num_slots"] * meta["slot_stride"]
        log.debug("mapped G2 segment %s: %d slots", self.path, meta["num_slots"])
        self._mm = mmap.mmap(self._fd, size)
        self.num_slots, self.ways = meta["num_slots"], meta["ways"]
        self.num_sets = self.num_slots // self.ways
        self._meta = np.ndarray((len(_META_FIELDS),), dtype="<u8", buffer=self._mm)
        self._slots = np.ndarray((self.num_slots,), dtype=SLOT_HEADER, buffer=self._mm, offset=PAGE)
        self._data = np.ndarray(
            (self.num_slots, meta["slot_stride"]), dtype=np.uint8, buffer=self._mm, offset=meta["data_offset"]
        )

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _tick(self) -> int:
        clock = int(self._meta[CLOCK])
        self._meta[CLOCK] = clock + 1
        return clock

    @property
    def capacity_blocks(self) -> int:
        return self.num_slots

    @property
    def closed(self) -> bool:
        return self._fd < 0

    @property
    def used_blocks(self) -> int:
        return int(np.count_nonzero(self._slots["state"] == READY))

    def payload(self, slot: int) -> np.ndarray:
        return self._data[slot, : self.block_bytes]

    def _find(self, block_hashes: Sequence[BlockHash], states: tuple[int, ...] = (READY,)) -> np.ndarray:
        """Slot of each hash in the given states, or -1 (caller holds the lock)."""
        hashes = np.fromiter(block_hashes, dtype="<u8", count=len(block_hashes))
        num_sets, ways = np.uint64(self.num_sets), np.arange(self.ways, dtype=np.int64)
        sets = np.stack([hashes % num_sets, (hashes >> np.uint64(32)) % num_sets], axis=1).astype(np.int64)
        candidates = (sets[:, :, None] * self.ways + ways).reshape(len(hashes), 2 * self.ways)
        rows = self._slots[candidates]
        match = (rows["hash"] == hashes[:, None]) & np.isin(rows["state"], states)
        found = match.any(axis=1)
        chosen = candidates[np.arange(len(hashes)), match.argmax(axis=1)]
        return np.where(found, chosen, -1)

    def contains(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        if not block_hashes:
            return []
        with self._locked():
            return (self._find(block_hashes) >= 0).tolist()

    def _touch(self, slot: int) -> None:
        header = self._slots[slot]
        header["last_use"] = self._tick()
        header["uses"] = min(int(header["uses"]) + 1, 0xFFFFFFFF)

    def _candidate_slots(self, block_hash: BlockHash) -> np.ndarray:
        """The 2 x `ways` slots `block_hash` may occupy: its first set, then its second."""
        sets = (int(block_hash) % self.num_sets, (int(block_hash) >> 32) % self.num_sets)
        return np.concatenate([np.arange(s * self.ways, (s + 1) * self.ways) for s in sets])

    def _victim(self, block_hash: BlockHash) -> int:
        """A free slot of whichever of the hash's two sets has more free slots (the two-choice rule that keeps the
        fullest set near the mean), else the least recently used unpinned one, or -1 if all are busy."""
        slots = self._candidate_slots(block_hash)
        rows = self._slots[slots]
        empty = rows["state"] == EMPTY
        if empty.any():
            second = int(np.count_nonzero(empty[self.ways :])) > int(np.count_nonzero(empty[: self.ways]))
            return int(slots[self.ways * second + int(np.argmax(empty[self.ways * second :]))])
        stale = [i for i in np.flatnonzero(rows["state"] == WRITING) if not pid_alive(int(rows["pid"][i]))]
        if stale:
            return int(slots[stale[0]])
        idle = np.flatnonzero((rows["state"] == READY) & (rows["pins"] == 0))
        if not idle.size:
            return -1
        return int(slots[idle[np.argmin(rows["last_use"][idle])]])

    def _claim(
        self, block_hashes: Sequence[BlockHash]
    ) -> tuple[list[tuple[int, int]], PutResult, list[EvictedBlock]]:
        """Under the lock: touch present blocks, claim a WRITING slot for each absent one (first occurrence).
        Returns the (block index, slot) claims, the put's result, and the READY blocks the claims displace."""
        claims: list[tuple[int, int]] = []
        result, evicted = PutResult(), []
        present = self._find(block_hashes, (READY, WRITING))
        claimed: set[int] = set()
        for index, (block_hash, slot) in enumerate(zip(block_hashes, present.tolist(), strict=True)):
            if slot >= 0:
                self._touch(slot)
                continue
            if block_hash in claimed:
                continue
            victim = self._victim(block_hash)
            if victim < 0:
                result.rejected.append(index)
                continue
            header = self._slots[victim]
            if int(header["state"]) == READY:
                evicted.append(
                    EvictedBlock(
                        BlockHash(int(header["hash"])),
                        self.payload(victim),
                        int(header["uses"]),
                        bytes(header["owner"]).decode(errors="replace"),
                    )
                )
            header["hash"], header["state"], header["pins"], header["uses"] = block_hash, WRITING, 0, 1
            header["pid"], header["owner"], header["last_use"] = self._pid, self._owner, self._tick()
            claims.append((index, victim))
            claimed.add(block_hash)
            result.stored.append(block_hash)
        return claims, result, evicted

    def put(self, block_hashes: Sequence[BlockHash], blocks: Sequence[np.ndarray]) -> PutResult:
        """A block whose two sets are all pinned, being written, or claimed earlier in this batch is rejected;
        `on_evict` gets the displaced blocks before their slots are overwritten."""
        if not block_hashes:
            return PutResult()
        with self._locked():
            claims, result, evicted = self._claim(block_hashes)
        copied = False
        try:
            if evicted and self.on_evict is not None:
                self.on_evict(evicted)
            copy_blocks([(self.payload(slot), blocks[index]) for index, slot in claims])
            copied = True
        finally:  # never leave a slot WRITING behind a live pid: it would be lost until the segment is recreated
            with self._locked():
                for _, slot in claims:
                    self._slots[slot]["state"] = READY if copied else EMPTY
        return result

    def get(self, block_hashes: Sequence[BlockHash], dests: Sequence[np.ndarray]) -> list[bool]:
        if not block_hashes:
            return []
        with self.pinned(block_hashes, touch=True) as payloads:
            pairs = [
                (dest, payload) for payload, dest in zip(payloads, dests, strict=True) if payload is not None
            ]
            copy_blocks(pairs)
            return [payload is not None for payload in payloads]

    @contextmanager
    def pinned(
        self, block_hashes: Sequence[BlockHash], touch: bool = False
    ) -> Iterator[list[np.ndarray | None]]:
        """Views of the payloads of `block_hashes` in the segment (None where a block is not READY here),
        pinned until the `with` block ends: no process evicts or overwrites them meanwhile. `touch` counts
        this as a use (LRU order and `uses`); a flush to G3 does not."""
        with self._locked():
            slots = self._find(block_hashes)
            held = slots[slots >= 0]
            if touch:
                self._touch_many(held)
            np.add.at(self._slots["pins"], held, 1)
        try:
            yield [self.payload(slot) if slot >= 0 else None for slot in slots.tolist()]
        finally:
            with self._locked():
                np.subtract.at(self._slots["pins"], held, 1)

    def _touch_many(self, slots: np.ndarray) -> None:
        """Mark slots used now, in order (caller holds the lock)."""
        clock = int(self._meta[CLOCK])
        self._meta[CLOCK] = clock + len(slots)
        self._slots["last_use"][slots] = np.arange(clock, clock + len(slots), dtype=np.uint64)
        np.add.at(self._slots["uses"], slots, 1)

    def evict(self, num_blocks: int) -> list[BlockHash]:
        with self._locked():
            idle = np.flatnonzero((self._slots["state"] == READY) & (self._slots["pins"] == 0))
            victims = idle[np.argsort(self._slots["last_use"][idle], kind="stable")[:num_blocks]]
            hashes = [BlockHash(int(h)) for h in self._slots["hash"][victims]]
            self._slots["state"][victims] = EMPTY
        return hashes

    def owned_hashes(self, owner: str) -> list[BlockHash]:
        """READY blocks this owner stored (used to re-announce after a service restart)."""
        with self._locked():
            mask = (self._slots["state"] == READY) & (self._slots["owner"] == owner.encode()[:32])
            return [BlockHash(int(h)) for h in self._slots["hash"][mask]]

    def flush_candidates(self, owner: str | None, min_uses: int = 1) -> list[BlockHash]:
        """READY blocks used at least `min_uses` times, least recently used first: those `owner` stored, or
        with `owner` None those no owner has copied to its G3 yet (see `mark_flushed`)."""
        with self._locked():
            slots = self._slots
            mask = (slots["state"] == READY) & (slots["uses"] >= min_uses)
            mask &= (slots["owner"] == owner.encode()[:32]) if owner is not None else (slots["pid"] != 0)
            chosen = np.flatnonzero(mask)
            chosen = chosen[np.argsort(slots["last_use"][chosen], kind="stable")]
            return [BlockHash(int(h)) for h in slots["hash"][chosen]]

    def mark_flushed(self, block_hashes: Sequence[BlockHash]) -> None:
        """Their owner dealt with these blocks on close (copied them, or left them out as colder than what its
        G3 holds): the last user's `flush_candidates(None)` skips them."""
        if not block_hashes:
            return
        with self._locked():
            slots = self._find(block_hashes)
            self._slots["pid"][slots[slots >= 0]] = 0

    def leave(self) -> bool:
        """Stop counting as a user. True if no other process maps the segment any more: this pool then holds
        it exclusively (a process opening it waits) until `close` or `destroy`. Two users leaving at once may
        both find themselves alone: the first to get the lock removes the segment, so the other one, which gets
        the lock once the first has closed, sees the name gone (or a new segment under it) and is not last."""
        _lock_users(self._fd, fcntl.F_UNLCK)
        return _lock_users(self._fd, fcntl.F_WRLCK) and _same_file(self._fd, self.path)

    def close(self) -> None:
        """Unmap; the segment stays for the other workers of the node (see `destroy`)."""
        if self._fd < 0:
            return
        del self._meta, self._slots, self._data
        try:
            self._mm.close()
        except BufferError:
            log.warning("G2 segment %s still has views in use; leaving it mapped", self.path)
        os.close(self._fd)
        self._fd = -1

    def destroy(self) -> None:
        """Remove the segment from /dev/shm and close (node shutdown or tests). The name goes first, while
        this pool still holds its users lock: a process that opened the old file meanwhile sees it gone and
        makes a new one."""
        if self._fd >= 0 and _same_file(self._fd, self.path):
            self.path.unlink(missing_ok=True)
        self.close()


def pid_alive(pid: int) -> bool:
    """Is a process with this id running (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
