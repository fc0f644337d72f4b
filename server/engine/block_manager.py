"""The KV pool's blocks: allocation, prefix cache (G1), LRU reuse of freed blocks, and the hooks to lower tiers.

    free queue (head = next to reuse)                              cached: block_hash -> KVBlock
    [unhashed blocks ...][LRU hashed blocks ... most recent]       (referenced or free, all with token ids)

A block whose `ref_count` drops to 0 keeps its hash and stays findable until `allocate` pops it from the head of
the free queue; only then is it evicted (offloaded to the connector, BlockRemoved). A freed sequence gives its
blocks back tail first, so the end of a prefix is reused before its beginning. A request joining the queue
touches its cached prefix (moves it to the recent end), so requests ahead of it evict other free blocks first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvbm.api import BlockEvent, BlockRemoved, BlockStored, KVConnector
from kvbm.block_hash import BlockHash
from server.engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class KVBlock:
    """One row of the pool. Linked into the free queue iff ref_count == 0 (prev/next are the links)."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # for the collision guard on a hit
    parent_hash: BlockHash | None = None
    prev: KVBlock | None = None
    next: KVBlock | None = None


class FreeBlockQueue:
    """Doubly linked list with sentinels: O(1) push at either end, pop at the head, removal from the middle."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        self._link(block, self.tail.prev, self.tail)

    def appendleft(self, block: KVBlock) -> None:
        self._link(block, self.head, self.head.next)

    def _link(self, block: KVBlock, before: KVBlock, after: KVBlock) -> None:
        block.prev, block.next = before, after
        before.next = after.prev = block
        self.size += 1

    def remove(self, block: KVBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1

    def popleft(self) -> KVBlock:
        block = self.head.next
        if block is self.tail:
            raise IndexError("no free KV blocks")
        self.remove(block)
        return block


class BlockManager:
    """Owns the pool's block bookkeeping; the pool tensor itself lives in the model runner."""

    def __init__(self, num_blocks: int, block_size: int, connector: KVConnector | None = None) -> None:
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.connector = connector
        self.rows: np.ndarray | None = (
            None  # [num_blocks, block_bytes] uint8 view of the pool (handoff reads)
        )

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence (some may still hold cached prefixes)."""
        return self.free_queue.size

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash (referenced or free)."""
        return len(self.cached)

    def match_prefix(self, seq: Sequence) -> list[KVBlock]:
        """Leading cached blocks of `seq`, at most `seq.num_reusable_blocks` (the block holding its last token is
        computed to get logits, and so are blocks whose prompt logprobs are owed). Token ids are compared so a hash collision is a miss, not wrong output."""
        limit = seq.num_reusable_blocks
        hits: list[KVBlock] = []
        for index in range(min(limit, len(seq.block_hashes))):
            block = self.cached.get(seq.block_hashes[index])
            if block is None or block.token_ids != seq.block_tokens(index):
                break
            hits.append(block)
        return hits

    def touch(self, hits: list[KVBlock]) -> None:
        """Make free prefix-hit blocks the most recently used, first block last (so a prefix's tail still goes
        first): a queued request's cached prefix then outlives the blocks that requests ahead of it evict."""
        for block in reversed(hits):
            if block.ref_count == 0:
                self.free_queue.remove(block)
                self.free_queue.append(block)

    def num_allocatable(self, hits: list[KVBlock]) -> int:
        """Free blocks left after taking `hits` (free hits leave the free queue)."""
        return self.num_free_blocks - sum(1 for block in hits if block.ref_count == 0)

    def take(self, seq: Sequence, hits: list[KVBlock]) -> None:
        """Reference prefix-hit blocks as the start of `seq`'s block table."""
        for block in hits:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        seq.num_registered_blocks = len(hits)

    def allocate(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Append `num_blocks` fresh blocks to `seq`, evicting cached ones (offload first). Caller checked room."""
        taken = [self.free_queue.popleft() for _ in range(num_blocks)]
        evicted = [block for block in taken if block.block_hash is not None]
        if evicted:
            started = time.time_ns() if seq.trace is not None else 0
            self._evict(evicted)
            if seq.trace is not None:  # the request waited for these blocks' offload
                seq.trace.offloaded(started, time.time_ns(), len(evicted))
        for block in taken:
            block.ref_count = 1
            seq.block_table.append(block.block_id)
        return [block.block_id for block in taken]

    def _evict(self, evicted: list[KVBlock]) -> None:
        hashes = tuple(block.block_hash for block in evicted)
        if self.connector is not None:
            with _connector_failure("offload", "the blocks are dropped"):
                self.connector.offload(list(hashes), [block.block_id for block in evicted])
        for block in evicted:
            del self.cached[block.block_hash]
            block.block_hash = block.token_ids = block.parent_hash = None
        self._notify(BlockRemoved(hashes))

    def forget_cached(self) -> int:
        """Drop every cached block without offloading it (the pool's contents are lost: a rank of a sharded
        worker died), announcing them removed. Call with no sequence holding a block. Returns how many."""
        hashes = tuple(self.cached)
        for block in self.cached.values():
            block.block_hash = block.token_ids = block.parent_hash = None
        self.cached.clear()
        if hashes:
            self._notify(BlockRemoved(hashes))
        return len(hashes)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq`'s block table hold `num_tokens` tokens; False (nothing changed) if the pool is short."""
        needed = -(-num_tokens // self.block_size) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        self.allocate(seq, needed)
        return True

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references, tail first; unhashed blocks go to the head (reused before cached ones)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def register_full_blocks(self, seq: Sequence) -> None:
        """Offer every newly computed full block of `seq` to the prefix cache and announce it."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for index in range(seq.num_registered_blocks, full):
            block_hash = seq.block_hashes[index]
            block = self.blocks[seq.block_table[index]]
            if block_hash in self.cached or block.block_hash is not None:
                continue  # an equal block is already cached; this copy stays private
            parent = seq.block_hashes[index - 1] if index else None
            self._store(block, block_hash, parent, seq.block_tokens(index))
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def _store(self, block: KVBlock, block_hash: BlockHash, parent: BlockHash | None, tokens: tuple) -> None:
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent, tokens
        self.cached[block_hash] = block
        self._notify(BlockStored(block_hash, parent, tokens, block.block_id))

    def _notify(self, event: BlockEvent) -> None:
        if self.connector is not None:
            with _connector_failure("on_event", "the index misses this event"):
                self.connector.on_event(event)

    def receive(self, seq: Sequence, num_hits: int, max_blocks: int) -> tuple[int, bool]:
        """Read the blocks after the `num_hits` cached ones from `seq`'s handoff (a prefill worker's KV, see
        kvbm/transfer.py) into fresh rows (at most `max_blocks`) and register them; the handoff is released either
        way (after a preemption its blocks are found in the prefix cache, or recomputed). Returns (blocks read,
        complete): not complete when a read stopped short, whose trailing rows stay for prefill."""
        transfer = seq.kv_transfer
        source = transfer.source if transfer is not None else None
        if source is None:
            return 0, True
        transfer.source = None
        try:
            limit = min(seq.num_reusable_blocks, source.num_blocks)
            count = min(limit - num_hits, max_blocks)
            if count <= 0 or self.rows is None:
                return 0, True
            rows = self.allocate(seq, count)
            started, valid = time.perf_counter(), 0
            with _connector_failure("handoff read", "counted as a miss: the rows are prefilled"):
                valid = min(source.read_into(num_hits, [self.rows[row] for row in rows]), count)
            transfer.received = (time.perf_counter() - started, valid * self.rows.shape[1])
            self._register_loaded(seq, num_hits, rows[:valid])
            return valid, valid == count
        finally:
            source.release()

    def _register_loaded(self, seq: Sequence, first: int, rows: list[int]) -> None:
        """Offer blocks `first`, `first + 1`, ... of `seq`, just loaded into `rows`, to the prefix cache."""
        for offset, row in enumerate(rows):
            index = first + offset
            if seq.block_hashes[index] not in self.cached:
                parent = seq.block_hashes[index - 1] if index else None
                self._store(self.blocks[row], seq.block_hashes[index], parent, seq.block_tokens(index))

    def onboard(self, seq: Sequence, num_g1_hits: int, max_blocks: int) -> int:
        """Ask the connector for blocks after the G1 hits (at most `max_blocks`), load them into fresh rows of
        `seq`, and register them. Returns how many blocks are valid; rows of invalid ones stay for prefill."""
        if self.connector is None or max_blocks <= 0:
            return 0
        wanted = seq.block_hashes[num_g1_hits : seq.num_reusable_blocks]
        found = 0
        with _connector_failure("lookup", "counted as a miss"):
            found = self.connector.lookup(wanted)
        found = min(found, max_blocks, len(wanted))
        if found <= 0:
            return 0
        rows = self.allocate(seq, found)
        valid, reads = 0, [] if seq.trace is not None else None
        with _connector_failure("onboard", "counted as a miss: the rows are prefilled"):
            valid = self.connector.onboard(wanted[:found], rows, reads)
        if reads:
            seq.trace.onboarded(reads)  # type: ignore[union-attr]
        valid = min(valid, found)
        self._register_loaded(seq, num_g1_hits, rows[:valid])
        return valid


@contextmanager
def _connector_failure(call: str, outcome: str) -> Iterator[None]:
    """A failing KV connector never takes the engine down: its exception is logged with `outcome`, what the
    engine does instead (the caller's result keeps the value it had before the call)."""
    try:
        yield
    except Exception:
        log.exception("KV connector %s failed; %s", call, outcome)
