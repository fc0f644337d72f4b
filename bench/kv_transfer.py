"""What a prefill -> decode KV handoff costs: one request's prompt blocks moved between two pools through
kvbm/transfer.py's transports, against the memcpy floor of the same run.

SmolLM2-135M's fp32 layout (30 layers, 3 KV heads, head_dim 64, 16-token blocks: 737,280 B a block);
prompts of 512, 2,048 and 8,192 tokens (32, 128 and 512 full blocks). The source rows are a shuffled block
table's rows of one pool, the destination rows fresh rows of another, as the two engines hold them. Each
path is timed end to end in this one process (the two engines' sides run back to back):

    shm     ShmTransport: send (one gather write into /dev/shm), fetch, read_into (one scatter read),
            release
    tcp     TcpTransport over 127.0.0.1, CURVE-encrypted: send (one copy), fetch (the pull), read_into (one
            memcpy per row out of the received frames), release. Sender and fetcher are two transports: two
            ZMQ contexts, so encryption and decryption run on two I/O threads, as in two processes
    wire    the same bytes over ZMQ on 127.0.0.1 without CURVE (one frame per block, two contexts): tcp's
            floor without encryption and without its two copies
    memcpy  np.copyto of the same rows into a preallocated buffer: the floor of one copy; 2x memcpy is the
            floor of a two-copy path (what shm does, and tcp before its wire and crypto)

Rounds interleave the paths (their order rotates); the report has medians: seconds, GB/s, the ratio to the
memcpy floor, and the engine threads' shares (send runs on the prefill engine's thread, read_into on the
decode engine's; fetch on the decode side's fetch thread).

    python bench/kv_transfer.py [--tokens 512 2048 8192] [--rounds 7] [--shm-dir /dev/shm]

Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kvbm.transfer import SHM_DIR, ShmTransport  # noqa: E402
from kvbm.transfer_tcp import TcpTransport  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS, DTYPE_BYTES = 30, 3, 64, 16, 4
BLOCK_BYTES = LAYERS * 2 * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 737,280
SECRET = b"bench-kv-transfer-secret-0123456789"
PATHS = ("shm", "tcp", "wire", "memcpy")


class Handoff:
    """One request's blocks: source rows of one pool, destination rows of another."""

    def __init__(self, tokens: int, rng: np.random.Generator) -> None:
        self.num_blocks = tokens // BLOCK_TOKENS
        pool_blocks = 2 * self.num_blocks  # the block table uses half of each pool, shuffled
        source_pool = rng.integers(0, 256, (pool_blocks, BLOCK_BYTES), dtype=np.uint8)
        self.dest_pool = np.zeros((pool_blocks, BLOCK_BYTES), dtype=np.uint8)
        self.hashes = [int(h) for h in rng.integers(1, 2**63, self.num_blocks)]
        self.rows = [source_pool[b] for b in rng.permutation(pool_blocks)[: self.num_blocks]]
        self.dest_rows = [self.dest_pool[b] for b in rng.permutation(pool_blocks)[: self.num_blocks]]
        self.floor_buffer = np.empty((self.num_blocks, BLOCK_BYTES), dtype=np.uint8)

    @property
    def bytes(self) -> int:
        return self.num_blocks * BLOCK_BYTES

    def check(self) -> None:
        for row, dest in zip(self.rows, self.dest_rows, strict=True):
            if not np.array_equal(row, dest):
                raise RuntimeError("a destination row differs from its source row")
        for row in self.dest_rows:
            row[:] = 0


def timed_transport(
    sender: ShmTransport | TcpTransport, fetcher: ShmTransport | TcpTransport, handoff: Handoff
) -> dict[str, float]:
    """Seconds of each step of one handoff from `sender` to `fetcher`, and of all of them."""
    t0 = time.perf_counter()
    location = sender.send(handoff.hashes, handoff.rows)
    t1 = time.perf_counter()
    source = fetcher.fetch(location, handoff.hashes, BLOCK_BYTES)
    t2 = time.perf_counter()
    filled = source.read_into(0, handoff.dest_rows)
    t3 = time.perf_counter()
    source.release()
    t4 = time.perf_counter()
    if filled != handoff.num_blocks:
        raise RuntimeError(f"{sender.name}: read {filled} of {handoff.num_blocks} blocks")
    return {"total": t4 - t0, "send": t1 - t0, "fetch": t2 - t1, "read_into": t3 - t2}


class PlainWire:
    """A DEALER -> ROUTER pair on 127.0.0.1 without CURVE, each end in its own context (as two processes)."""

    def __init__(self) -> None:
        self.contexts = zmq.Context(), zmq.Context()
        self.server = self.contexts[0].socket(zmq.ROUTER)
        self.client = self.contexts[1].socket(zmq.DEALER)
        port = self.server.bind_to_random_port("tcp://127.0.0.1")
        self.client.connect(f"tcp://127.0.0.1:{port}")

    def timed(self, handoff: Handoff) -> dict[str, float]:
        """Seconds of one request and its answer: the (contiguous) blocks, one zero-copy frame each."""
        start = time.perf_counter()
        self.client.send(b"key")
        peer, _ = self.server.recv_multipart()
        self.server.send_multipart([peer, *handoff.floor_buffer], copy=False)
        frames = self.client.recv_multipart(copy=False)
        elapsed = time.perf_counter() - start
        if sum(len(frame) for frame in frames) != handoff.bytes:
            raise RuntimeError(f"wire: {sum(len(f) for f in frames)} of {handoff.bytes} bytes arrived")
        return {"total": elapsed}

    def close(self) -> None:
        self.server.close(linger=0)
        self.client.close(linger=0)
        for context in self.contexts:
            context.term()


def timed_memcpy(handoff: Handoff) -> dict[str, float]:
    """Seconds of one copy of the same rows into a preallocated buffer."""
    start = time.perf_counter()
    for row, slot in zip(handoff.rows, handoff.floor_buffer, strict=True):
        np.copyto(slot, row)
    return {"total": time.perf_counter() - start}


def measure(tokens: int, rounds: int, shm: ShmTransport, tcp: tuple[TcpTransport, TcpTransport]) -> dict:
    handoff = Handoff(tokens, np.random.default_rng(tokens))
    wire = PlainWire()
    runs: dict[str, Callable[[], dict[str, float]]] = {
        "shm": lambda: timed_transport(shm, shm, handoff),
        "tcp": lambda: timed_transport(*tcp, handoff),
        "wire": lambda: wire.timed(handoff),
        "memcpy": lambda: timed_memcpy(handoff),
    }
    for name in ("shm", "tcp"):  # warm-up, and a check that the blocks arrive intact
        runs[name]()
        handoff.check()
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in PATHS}
    try:
        for round_number in range(rounds):
            for i in range(len(PATHS)):
                name = PATHS[(round_number + i) % len(PATHS)]
                samples[name].append(runs[name]())
    finally:
        wire.close()
    medians = {
        name: {step: statistics.median(s[step] for s in samples[name]) for step in samples[name][0]}
        for name in PATHS
    }
    return {"tokens": tokens, "blocks": handoff.num_blocks, "bytes": handoff.bytes, "median_s": medians}


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()[0]
    shm = ShmTransport(directory=args.shm_dir)
    tcp = tuple(TcpTransport(SECRET, bind_host="127.0.0.1", fetch_timeout_s=60.0) for _ in range(2))
    try:
        sizes = [measure(tokens, args.rounds, shm, tcp) for tokens in args.tokens]
    finally:
        shm.close()
        for transport in tcp:
            transport.close()
    return {
        "bench": "kv_transfer", "block_bytes": BLOCK_BYTES, "rounds": args.rounds, "cpus": os.cpu_count(),
        "load_avg_1m": [load_before, os.getloadavg()[0]], "sizes": sizes,
    }  # fmt: skip


def report(result: dict) -> None:
    load_before, load_after = result["load_avg_1m"]
    print(
        f"KV handoff of one prompt, SmolLM2-135M fp32 blocks of {BLOCK_BYTES:,} B, "
        f"median of {result['rounds']} interleaved rounds; {result['cpus']} CPUs, 1-minute load average "
        f"{load_before:.1f} before, {load_after:.1f} after"
    )
    print()
    print(
        "| tokens | MB | path | seconds | GB/s | x memcpy | x 2x memcpy | send ms | fetch ms | read_into ms |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for size in result["sizes"]:
        medians, floor = size["median_s"], size["median_s"]["memcpy"]["total"]
        rows = [(name, medians[name]) for name in PATHS]
        rows.append(("2x memcpy", {"total": 2 * floor}))
        for name, steps in rows:
            total = steps["total"]
            steps_ms = [
                f"{steps[step] * 1e3:.1f}" if step in steps else "" for step in ("send", "fetch", "read_into")
            ]
            print(
                f"| {size['tokens']} | {size['bytes'] / 1e6:.1f} | {name} | {total:.4f} | "
                f"{size['bytes'] / total / 1e9:.2f} | {total / floor:.2f} | {total / (2 * floor):.2f} | "
                + " | ".join(steps_ms)
                + " |"
            )
    print()
    print(json.dumps(result))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192], help="prompt lengths")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shm-dir", type=Path, default=SHM_DIR, help="folder for shm handoffs (a tmpfs)")
    return parser.parse_args()


if __name__ == "__main__":
    report(run(parse_args()))
