"""G5: KV blocks as objects in an S3-compatible bucket, shared by every server that names the same URL and
outliving all of them (AWS S3, MinIO, Ceph, SeaweedFS, GCS through its S3 API).

    <prefix>/<layout tag>/<block hash, 16 hex>   one object per block: a signed block (kvbm/signing.py)
    <prefix>/<layout tag>/layout.txt             the layout the tag names (model, dtype, block size, shape,
                                                 tensor-parallel layout), written once, for whoever browses

One object per block, not runs of them: a block is the unit every other tier and the index deal in (its hash
names its whole prefix), so any server reuses any prefix of any prompt; what runs of blocks gained in
bench/kvbm.py was not worth giving that up (docs/kvbm.md).

Client: obstore (Rust's object_store: no hand-written signing, the standard AWS_* environment, path-style
requests to a custom endpoint), through its async API on one event loop thread that owns the store (its sync
calls from a thread pool stalled on their first request here). MACs are checked and rows copied on that loop as
each GET completes: the hops to a thread pool cost more than its parallel hashing saves. obstore, the loop and
the concurrency below were chosen by measurement (docs/kvbm.md).

Where each call runs:
  put       on the engine thread only a copy of the G1 row (it is reused as soon as offload returns); the
            signing and the PUT happen on the tier's loop, at most UPLOAD_QUEUE_BYTES queued (past it a block
            is dropped and counted: the bucket is a cache). A block this process knows is there is not sent again,
            and an upload first asks (HEAD) whether another server wrote it. Blocks become `stored` for the index
            only once their PUT succeeded (`take_changes`, drained on the engine thread).
  contains  blocks this process knows to be there cost nothing; otherwise one HEAD of the first unknown
            block (a miss ends there: one request, bounded by LOOKUP_TIMEOUT_S, then remembered for
            NEGATIVE_TTL_S), and only when it exists the rest at once (bounded by REST_TIMEOUT_S: the leading
            run answered by then is the hit).
  get       concurrent GETs (at most IO_CONCURRENCY), each verified and copied into its G1 row as it arrives;
            a call waits at most the request timeout, and rows whose copy had not begun by then are never
            written (the engine prefills them).
Faults: every request has a timeout, and a failed one (unreachable, refused credentials, 503 SlowDown, a
timeout) opens a circuit breaker, so a dead endpoint costs one timeout and then nothing until the breaker lets
one request through again (CIRCUIT_OPEN_S, doubling up to CIRCUIT_MAX_S while failures go on). A value whose
size, header or MAC is wrong (half-written, tampered, another layout) is a miss, counted in
`kvbm_checksum_failures{tier="G5"}`, and deleted. Every request's outcome is counted in
`kvbm_object_requests_total{op, outcome}`; `kvbm_object_store_up` is 0 while the breaker is open.
Capacity: with `capacity_blocks` > 0 the least recently used objects this process knows of (its own writes and
hits, and the listing it reads at start) are deleted past it; a bucket shared by many servers is better bounded
by the store's own lifecycle rule (docs/kvbm.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlparse

import numpy as np

from cluster.backoff import Backoff
from kvbm.block_hash import BlockHash
from kvbm.metrics import TierMetrics
from kvbm.signing import BlockSeal
from kvbm.tier import PutResult, layout_tag

log = logging.getLogger(__name__)
T = TypeVar("T")

MAGIC = 0x354756424B415254  # "TRAKBVG5"
LOOKUP_TIMEOUT_S = 0.05  # the HEAD that decides a miss: a slow store costs a recompute, not a slow TTFT
REST_TIMEOUT_S = 0.25  # a hit's other HEADs (the engine thread waits on them): late ones are misses
NEGATIVE_TTL_S = 2.0  # a block found absent is not asked for again this long (a queued request's retries)
UPLOAD_QUEUE_BYTES = 256 << 20  # block copies waiting for their PUT
IO_CONCURRENCY = 32  # GETs and HEADs in flight (fewer onboarded slower: docs/kvbm.md)
UPLOAD_CONCURRENCY = 4  # PUTs in flight: uploads must not crowd out an onboarding's GETs
CIRCUIT_OPEN_S, CIRCUIT_MAX_S = 1.0, 30.0
KNOWN_LIMIT = 1 << 18  # blocks remembered as present when no capacity bounds the tier
NEGATIVE_LIMIT = 1 << 16


def parse_object_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of `s3://BUCKET/PREFIX`; ValueError saying what is wrong."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"{url!r} is not s3://BUCKET/PREFIX")
    if parsed.query or parsed.fragment:
        raise ValueError(f"{url!r}: no query or fragment in an object-store URL")
    return parsed.netloc, parsed.path.strip("/")


def open_store(url: str, timeout_s: float):
    """An obstore S3Store for `url`: credentials, region and endpoint from the standard AWS environment
    (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL), path-style
    requests, plain HTTP allowed only when the endpoint says http://. One retry inside the client (a pooled
    connection the store closed), within the same timeout; past that the circuit breaker decides when to try
    again."""
    from obstore.store import S3Store

    parse_object_url(url)
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    return S3Store.from_url(
        url,
        virtual_hosted_style_request=False,
        client_options={
            "allow_http": endpoint.startswith("http://"),
            "timeout": timedelta(seconds=timeout_s),
            "connect_timeout": timedelta(seconds=min(timeout_s, 1.0)),
        },
        retry_config={
            "max_retries": 1,
            "backoff": {
                "init_backoff": timedelta(milliseconds=10),
                "max_backoff": timedelta(seconds=1),
                "base": 2,
            },
            "retry_timeout": timedelta(seconds=timeout_s),
        },
    )


def outcome_of(error: BaseException) -> str:
    """The `outcome` label of a failed request: missing, denied, throttled, timeout or error."""
    import obstore.exceptions as oe

    if isinstance(error, FileNotFoundError | oe.NotFoundError):
        return "missing"
    if isinstance(error, oe.PermissionDeniedError | oe.UnauthenticatedError):
        return "denied"
    text = str(error)
    if "SlowDown" in text or "status code: 503" in text:
        return "throttled"
    if isinstance(error, TimeoutError) or "kind: Timeout" in text or "TimedOut" in text:
        return "timeout"
    return "error"


class CircuitBreaker:
    """Closed: every call goes. After a failure: open for `open_s` (doubling while failures go on, up to
    `max_s`), no call goes; then one call goes through (half-open) and its outcome closes or reopens it."""

    def __init__(self, open_s: float = CIRCUIT_OPEN_S, max_s: float = CIRCUIT_MAX_S, on_change=None) -> None:
        self._open = Backoff(open_s, max_s)
        self._until = 0.0  # monotonic end of the open period; 0: closed
        self._probing = False
        self._lock = threading.Lock()
        self._on_change: Callable[[bool], None] | None = on_change

    @property
    def closed(self) -> bool:
        return self._until == 0.0

    def allow(self) -> bool:
        with self._lock:
            if self._until == 0.0:
                return True
            if self._probing or time.monotonic() < self._until:
                return False
            self._probing = True  # the one call of the half-open state
            return True

    def success(self) -> None:
        with self._lock:
            was_open, self._until, self._probing = self._until != 0.0, 0.0, False
            self._open.reset()
        if was_open and self._on_change is not None:
            self._on_change(True)

    def failure(self) -> None:
        with self._lock:
            was_closed = self._until == 0.0
            self._until = time.monotonic() + self._open.delay
            if not was_closed:
                self._open.grow()
            self._probing = False
        if was_closed and self._on_change is not None:
            self._on_change(False)


class ObjectPool:
    """G5 tier, a `WriteBehind` one (see module docstring). `store_factory`: makes the obstore store on the tier's loop (default:
    `open_store(url, timeout_s)`)."""

    name, level, remote, ttl_s = "G5", 5, True, 0

    def __init__(
        self,
        url: str,
        mac_key: bytes,
        fingerprint: str,
        block_bytes: int,
        capacity_blocks: int = 0,
        timeout_s: float = 2.0,
        metrics: TierMetrics | None = None,
        store_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.url = url
        self.block_bytes = block_bytes
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.on_evict = None  # evictions are reported through take_changes (they happen on the tier's loop)
        self._capacity = capacity_blocks
        tag = layout_tag(fingerprint)
        self._fingerprint = fingerprint
        self._dir = f"{tag}/"
        self._seal = BlockSeal(mac_key, MAGIC, int(tag, 16), block_bytes)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the upload queue empties
        self._known: OrderedDict[BlockHash, None] = OrderedDict()  # present in the bucket, LRU first
        self._absent: dict[BlockHash, float] = {}  # found missing: until when (monotonic) that answer holds
        self._queued: set[BlockHash] = set()
        self._queued_bytes = 0
        self._stored: list[BlockHash] = []  # uploaded since the last take_changes
        self._removed: list[BlockHash] = []
        self._breaker = CircuitBreaker(on_change=self._set_up)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvbm-g5", daemon=True)
        self._thread.start()
        factory = store_factory or (lambda: open_store(url, timeout_s))
        self._store = self._run(self._in_loop(factory), None)
        self._io_slots = asyncio.Semaphore(IO_CONCURRENCY)
        self._upload_slots = asyncio.Semaphore(UPLOAD_CONCURRENCY)
        self._set_up(True)
        self._started = asyncio.run_coroutine_threadsafe(self._start(), self._loop)

    # -- bookkeeping -----------------------------------------------------------------------------------------

    def key(self, block_hash: BlockHash) -> str:
        return f"{self._dir}{block_hash:016x}"

    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    @property
    def used_blocks(self) -> int:
        """Blocks this process knows to be in the bucket (its writes, its hits, the listing read at start)."""
        return len(self._known)

    @staticmethod
    async def _in_loop(function: Callable[[], T]) -> T:
        return function()

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
        """Run `coro` on the tier's loop and wait for it (TimeoutError past `timeout_s`: it is cancelled)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError from None

    def _count(self, op: str, outcome: str, n: int = 1) -> None:
        if self.metrics is not None and n:
            self.metrics.record_object_request(self.name, op, outcome, n)

    def _set_up(self, up: bool) -> None:
        if self.metrics is not None:
            self.metrics.set_object_up(self.name, up)

    def _failed(self, op: str, error: BaseException) -> None:
        outcome = outcome_of(error)
        self._count(op, outcome)
        if outcome == "missing":
            self._breaker.success()  # the store answered: a half-open probe that finds nothing closes the circuit
        else:
            if self._breaker.closed:
                log.warning(
                    "kvbm G5 %s: %s failed (%s: %s); lookups are misses and writes are skipped until it answers",
                    self.url, op, outcome, str(error).splitlines()[0][:300],
                )  # fmt: skip
            self._breaker.failure()

    def _remember(self, block_hash: BlockHash) -> list[BlockHash]:
        """Mark a block present (most recent); returns the hashes past the capacity, already forgotten."""
        with self._lock:
            self._known[block_hash] = None
            self._known.move_to_end(block_hash)
            self._absent.pop(block_hash, None)
            limit = self._capacity or KNOWN_LIMIT
            excess = [self._known.popitem(last=False)[0] for _ in range(max(0, len(self._known) - limit))]
        return excess if self._capacity else []

    def _forget(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._known.pop(block_hash, None)

    def _mark_absent(self, block_hash: BlockHash) -> None:
        with self._lock:
            if len(self._absent) >= NEGATIVE_LIMIT:
                self._absent.pop(next(iter(self._absent)))
            self._absent[block_hash] = time.monotonic() + NEGATIVE_TTL_S

    def _known_absent(self, block_hash: BlockHash) -> bool:
        until = self._absent.get(block_hash)
        return until is not None and time.monotonic() < until

    def unknown(self, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """The blocks this process neither knows to be in the bucket nor has queued (no request)."""
        with self._lock:
            return [h for h in block_hashes if h not in self._known and h not in self._queued]

    def take_changes(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """Blocks uploaded and blocks deleted (capacity, corrupt) since the last call: the index's events."""
        with self._lock:
            stored, self._stored = self._stored, []
            removed, self._removed = self._removed, []
        return stored, removed

    # -- start ----------------------------------------------------------------------------------------------

    def wait_started(self, timeout_s: float) -> None:
        """Wait for the start's listing (or its failure) to be done: tests and benches that want a settled tier."""
        self._started.result(timeout_s)

    async def _start(self) -> None:
        """Write the layout note and read what the bucket holds for this layout (oldest first, up to the
        capacity), which also tells whether the store answers (and logs why not)."""
        import obstore

        try:
            await obstore.put_async(
                self._store, f"{self._dir}layout.txt", (self._fingerprint + "\n").encode()
            )
            found: list[tuple[float, BlockHash]] = []
            async for chunk in obstore.list(self._store, prefix=self._dir, chunk_size=1000):
                for entry in chunk:
                    name = entry["path"].rsplit("/", 1)[-1]
                    if len(name) == 16 and entry["size"] == self._seal.value_bytes:
                        found.append((entry["last_modified"].timestamp(), BlockHash(int(name, 16))))
                if self._capacity and len(found) > 4 * self._capacity:
                    break
        except Exception as error:
            self._failed("list", error)
            log.error(
                "kvbm G5 %s: the object store did not answer at start (%s); the tier is degraded: "
                "lookups are misses until it does", self.url, str(error).splitlines()[0][:300],
            )  # fmt: skip
            return
        self._count("list", "ok")
        self._breaker.success()
        found.sort()
        for _, block_hash in found:
            for excess in self._remember(block_hash):
                await self._delete(excess)
        log.info(
            "kvbm G5 %s: the store answers; %d blocks of this layout in the bucket", self.url, len(found)
        )

    # -- lookup ---------------------------------------------------------------------------------------------

    async def _head(self, block_hash: BlockHash) -> bool:
        import obstore

        async with self._io_slots:
            try:
                await obstore.head_async(self._store, self.key(block_hash))
            except Exception as error:
                self._failed("head", error)
                if outcome_of(error) == "missing":
                    self._mark_absent(block_hash)
                return False
        self._count("head", "ok")
        self._breaker.success()
        for excess in self._remember(block_hash):
            await self._delete(excess)
        return True

    def _heads(self, block_hashes: Sequence[BlockHash], timeout_s: float, trip: bool) -> list[bool]:
        """HEAD the blocks concurrently; a block whose answer is not back within `timeout_s` counts as absent (its
        HEAD is cancelled), and with `trip` a late answer opens the circuit."""
        if not block_hashes:
            return []

        async def heads() -> tuple[list[bool], int]:
            tasks = [asyncio.ensure_future(self._head(h)) for h in block_hashes]
            done, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()
            return [task in done and task.result() for task in tasks], len(pending)

        found, late = self._run(heads(), timeout_s + 1.0)
        if late:
            self._count("head", "timeout", late)
            if trip:
                self._breaker.failure()
        return found

    def contains(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Per block: in the bucket now. Only the leading run is asked about (the connector uses no more): a
        block after the first absent one is reported absent without a request."""
        found = [False] * len(block_hashes)
        first = 0
        while first < len(block_hashes) and block_hashes[first] in self._known:
            found[first] = True
            first += 1
        if first == len(block_hashes) or self._known_absent(block_hashes[first]):
            return found
        if not self._breaker.allow():
            self._count("head", "skipped")
            return found
        if not self._heads([block_hashes[first]], LOOKUP_TIMEOUT_S, trip=True)[0]:
            return found
        found[first] = True
        rest = [i for i in range(first + 1, len(block_hashes)) if block_hashes[i] not in self._known]
        heads = self._heads([block_hashes[i] for i in rest], REST_TIMEOUT_S, trip=False)
        present = dict(zip(rest, heads, strict=True))
        for index in range(first + 1, len(block_hashes)):
            if not present.get(index, True):
                break
            found[index] = True
        return found

    # -- onboard --------------------------------------------------------------------------------------------

    def get(self, block_hashes: Sequence[BlockHash], dests: Sequence[np.ndarray]) -> list[bool]:
        """Concurrent GETs, each verified and copied into its row as it arrives (see module docstring)."""
        if not block_hashes:
            return []
        if not self._breaker.allow():
            self._count("get", "skipped", len(block_hashes))
            return [False] * len(block_hashes)
        gate = threading.Lock()
        open_gate = [True]  # False once this call has returned: no row is written after that
        written = [False] * len(block_hashes)

        def verify_into(index: int, value) -> bool:
            block_hash = block_hashes[index]
            payload = self._seal.verify(block_hash, value)
            if payload is None:
                return False
            with gate:
                if open_gate[0]:
                    dests[index][:] = np.frombuffer(payload, dtype=np.uint8)
                    written[index] = True
            return True

        async def fetch(index: int) -> None:
            import obstore

            block_hash = block_hashes[index]
            async with self._io_slots:
                try:
                    value = await (await obstore.get_async(self._store, self.key(block_hash))).bytes_async()
                except Exception as error:
                    self._failed("get", error)
                    if outcome_of(error) == "missing":
                        self._forget(block_hash)
                        self._mark_absent(block_hash)
                    return
            self._breaker.success()
            if verify_into(index, value):
                self._count("get", "ok")
                self._remember(block_hash)
            else:
                await self._corrupt(block_hash, len(value))

        async def fetch_all() -> None:
            await asyncio.gather(*(fetch(i) for i in range(len(block_hashes))))

        try:
            self._run(fetch_all(), self.timeout_s + 0.5)
        except TimeoutError:
            self._count("get", "timeout")
            self._breaker.failure()
        with gate:
            open_gate[0] = False
            return list(written)

    async def _corrupt(self, block_hash: BlockHash, size: int) -> None:
        log.warning(
            "G5 object of block %016x failed verification (%d bytes); treating it as a miss and deleting it",
            block_hash, size,
        )  # fmt: skip
        self._count("get", "corrupt")
        if self.metrics is not None:
            self.metrics.record_checksum_failure(self.name)
        self._forget(block_hash)
        await self._delete(block_hash)

    # -- offload --------------------------------------------------------------------------------------------

    def put(self, block_hashes: Sequence[BlockHash], blocks: Sequence[np.ndarray]) -> PutResult:
        """Queue copies of the blocks for upload; `stored` stays empty (uploads report through take_changes),
        `rejected` lists the blocks dropped because the queue is full or the store is failing."""
        result = PutResult()
        for index, (block_hash, block) in enumerate(zip(block_hashes, blocks, strict=True)):
            if block_hash in self._known or block_hash in self._queued:
                continue
            if not self._breaker.closed and not self._breaker.allow():
                self._count("put", "skipped")
                result.rejected.append(index)
                continue
            with self._lock:
                full = self._queued_bytes + self.block_bytes > UPLOAD_QUEUE_BYTES
                if not full:
                    self._queued_bytes += self.block_bytes
                    self._queued.add(block_hash)
            if full:
                self._count("put", "dropped")
                result.rejected.append(index)
                continue
            asyncio.run_coroutine_threadsafe(self._upload(block_hash, block.copy()), self._loop)
        return result

    async def _upload(self, block_hash: BlockHash, payload: np.ndarray) -> None:
        import obstore

        try:
            async with self._upload_slots:
                if await self._exists(block_hash):
                    self._count("put", "present")
                else:
                    value = self._seal.seal(block_hash, payload)
                    start = time.perf_counter()
                    await obstore.put_async(self._store, self.key(block_hash), value)
                    self._count("put", "ok")
                    if self.metrics is not None:
                        elapsed = time.perf_counter() - start
                        self.metrics.record_transfer("G1->G5", 1, self.block_bytes, elapsed)
                    self._breaker.success()
            with self._lock:
                self._stored.append(block_hash)
            for excess in self._remember(block_hash):
                await self._delete(excess)
        except Exception as error:
            self._failed("put", error)
        finally:
            with self._lock:
                self._queued.discard(block_hash)
                self._queued_bytes -= self.block_bytes
                if not self._queued:
                    self._idle.notify_all()

    async def _exists(self, block_hash: BlockHash) -> bool:
        """HEAD before PUT: another server may have written the block (raises on anything but a 404)."""
        import obstore

        try:
            await obstore.head_async(self._store, self.key(block_hash))
            return True
        except Exception as error:
            if outcome_of(error) != "missing":
                raise
            return False

    async def _delete(self, block_hash: BlockHash) -> None:
        import obstore

        try:
            await obstore.delete_async(self._store, self.key(block_hash))
            self._count("delete", "ok")
        except Exception as error:
            self._failed("delete", error)
        with self._lock:
            self._removed.append(block_hash)

    def evict(self, num_blocks: int) -> list[BlockHash]:
        with self._lock:
            oldest = [self._known.popitem(last=False)[0] for _ in range(min(num_blocks, len(self._known)))]

        async def delete_all() -> None:
            await asyncio.gather(*(self._delete(h) for h in oldest))

        try:
            self._run(delete_all(), self.timeout_s + 0.5)
        except TimeoutError:
            self._count("delete", "timeout")
        return oldest

    def owned_hashes(self, owner: str) -> list[BlockHash]:
        """None: G5 is indexed for everyone by the events of its writes, and listing it would scan the bucket."""
        return []

    def drain(self, deadline: float) -> int:
        """Wait (until `deadline`, time.monotonic()) for queued uploads; returns how many are left."""
        with self._idle:
            self._idle.wait_for(lambda: not self._queued, timeout=max(0.0, deadline - time.monotonic()))
            return len(self._queued)

    def close(self) -> None:
        """Stop the loop (uploads still queued are dropped: a graceful stop drains first, KVBMConnector.close)."""
        if self._loop.is_closed():
            return

        async def settle() -> None:  # let the deletions in flight finish, cancel the rest
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self._run(settle(), self.timeout_s)
        except TimeoutError:
            log.warning(
                "G5: requests in flight did not settle within %.0f s at close; cancelled", self.timeout_s
            )
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self.timeout_s)
        self._loop.close()
