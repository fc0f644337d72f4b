"""G4: blocks as binary Redis values, shared by every node that points at the same Redis.

    key    kvbm:blk:<layout tag>:<block hash, 16 hex>
    value  a signed block (kvbm/signing.py: header with a keyed BLAKE3 MAC, then the payload)
    kvbm:lru:<layout tag>   sorted set block-hash -> last use (unix s), our own capacity bound when
                            `capacity_blocks` > 0: after a put the oldest members beyond it are deleted

A get is one pipeline (MGET + touch of the LRU set); a value whose header or MAC does not match is a miss
plus `kvbm_checksum_failures{tier="G4"}`, never bytes: Redis is shared storage, not trusted storage. With a TTL every key expires on its own (the LRU set keeps
a dead member until it is trimmed, which only costs a later miss). Redis down: every call is a miss or a no-op.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cluster.redis_link import RedisLink
from kvbm.block_hash import BlockHash
from kvbm.metrics import TierMetrics
from kvbm.signing import BlockSeal
from kvbm.tier import EvictedBlock, EvictFn, PutResult, layout_tag

log = logging.getLogger(__name__)

FETCH_CHUNK_BLOCKS = 8  # blocks per MGET of an onboard (~6 MB of SmolLM2 fp32 KV)
MAGIC = 0x344756424B415254  # "TRAKBVG4"


class RedisPool:
    """G4 tier (see module docstring). `capacity_blocks` 0 means bounded only by the server's maxmemory."""

    name, level, remote = "G4", 4, True

    def __init__(
        self,
        link: RedisLink,
        mac_key: bytes,
        fingerprint: str,
        block_bytes: int,
        capacity_blocks: int = 0,
        ttl_s: int = 0,
        metrics: TierMetrics | None = None,
        on_evict: EvictFn | None = None,
    ) -> None:
        self.link = link
        self.block_bytes = block_bytes
        self.ttl_s = ttl_s
        self.metrics = metrics
        self.on_evict = on_evict  # told about blocks our LRU bound deletes
        self._capacity = capacity_blocks
        self._last_size = 0  # blocks in the LRU set after our last put
        tag = layout_tag(fingerprint)
        self._seal = BlockSeal(mac_key, MAGIC, int(tag, 16), block_bytes)
        self._prefix = f"kvbm:blk:{tag}:".encode()
        self._lru_key = f"kvbm:lru:{tag}".encode()
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbm-g4-fetch")

    def key(self, block_hash: BlockHash) -> bytes:
        return self._prefix + b"%016x" % block_hash

    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    @property
    def used_blocks(self) -> int:
        """Blocks in the LRU set after this process's last put (no round trip; other writers' later puts and
        expired keys are not seen)."""
        return self._last_size

    def contains(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        if not block_hashes:
            return []

        def query(r) -> list[bool]:
            pipe = r.pipeline(transaction=False)
            for block_hash in block_hashes:
                pipe.exists(self.key(block_hash))
            return [bool(n) for n in pipe.execute()]

        return self.link.call(query, [False] * len(block_hashes))

    def encode(self, block_hash: BlockHash, block: np.ndarray) -> bytes:
        return self._seal.seal(block_hash, block)

    def put(self, block_hashes: Sequence[BlockHash], blocks: Sequence[np.ndarray]) -> PutResult:
        """Every block is written (one pipeline), present or not; Redis down rejects them all."""
        if not block_hashes:
            return PutResult()
        now = time.time()

        def store(r) -> PutResult:
            pipe = r.pipeline(transaction=False)
            for block_hash, block in zip(block_hashes, blocks, strict=True):
                pipe.set(self.key(block_hash), self.encode(block_hash, block), ex=self.ttl_s or None)
            pipe.zadd(self._lru_key, {b"%016x" % h: now for h in block_hashes})
            pipe.zcard(self._lru_key)
            size = self._last_size = pipe.execute()[-1]
            if self._capacity and size > self._capacity:
                self._trim(r, size - self._capacity)
            return PutResult(stored=list(block_hashes))

        return self.link.call(store, PutResult(rejected=list(range(len(block_hashes)))))

    def _trim(self, r, excess: int) -> list[BlockHash]:
        oldest = [member for member, _ in r.zpopmin(self._lru_key, excess)]
        if not oldest:
            return []
        r.delete(*(self._prefix + member for member in oldest))
        evicted = [BlockHash(int(member, 16)) for member in oldest]
        if self.on_evict is not None:
            self.on_evict([EvictedBlock(block_hash) for block_hash in evicted])
        return evicted

    def get(self, block_hashes: Sequence[BlockHash], dests: Sequence[np.ndarray]) -> list[bool]:
        """Fetch in chunks of `FETCH_CHUNK_BLOCKS` on an I/O thread, verifying and copying each chunk here while
        the next one is in flight (BLAKE3 and the socket read both release the GIL), so the MAC costs little more
        than the last chunk's check."""
        if not block_hashes:
            return []
        now = time.time()
        starts = range(0, len(block_hashes), FETCH_CHUNK_BLOCKS)
        chunks = [block_hashes[i : i + FETCH_CHUNK_BLOCKS] for i in starts]

        def fetch(chunk: Sequence[BlockHash], touch: bool) -> list[bytes | None]:
            def run(r) -> list[bytes | None]:
                pipe = r.pipeline(transaction=False)
                pipe.mget([self.key(h) for h in chunk])
                if touch:
                    pipe.zadd(self._lru_key, {b"%016x" % h: now for h in block_hashes}, xx=True)
                return pipe.execute()[0]

            return self.link.call(run, [None] * len(chunk))

        found: list[bool] = []
        pending = self._fetcher.submit(fetch, chunks[0], True)
        for index, chunk in enumerate(chunks):
            values = pending.result()
            if index + 1 < len(chunks):
                pending = self._fetcher.submit(fetch, chunks[index + 1], False)
            start = index * FETCH_CHUNK_BLOCKS
            for offset, (block_hash, value) in enumerate(zip(chunk, values, strict=True)):
                found.append(self._decode_into(block_hash, value, dests[start + offset]))
        return found

    def _decode_into(self, block_hash: BlockHash, value: bytes | None, dest: np.ndarray) -> bool:
        if value is None:
            return False
        if not self._seal.open_into(block_hash, value, dest):
            log.warning(
                "G4 value of block %016x failed verification (%d bytes); treating it as a miss",
                block_hash,
                len(value),
            )
            if self.metrics is not None:
                self.metrics.record_checksum_failure(self.name)
            return False
        return True

    def evict(self, num_blocks: int) -> list[BlockHash]:
        return self.link.call(lambda r: self._trim(r, num_blocks), [])

    def owned_hashes(self, owner: str) -> list[BlockHash]:
        """None: G4 is indexed for everyone by the events of its writes, and listing it would scan Redis."""
        return []

    def close(self) -> None:
        self._fetcher.shutdown(wait=True)
        self.link.close()
