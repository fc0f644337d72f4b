"""How long a graceful stop spends copying G2 to G3: `KVBMConnector.close()` with a full G2 of SmolLM2 blocks.

G2 holds `--blocks` SmolLM2-sized blocks (fp32, 16 tokens: 737,280 B), offloaded from a G1 pool through the
real path; G3 starts empty and has room for all of them. Measured per round: the whole `close()` (copy every
block to G3, then remove the segment), its G2 -> G3 put time (the connector's `kvbm_transfer_seconds` metric),
and in the same round, on the same disk, the floor: a sequential write of the same bytes in 47 MB chunks into
a fresh preallocated file (with `--fsync`: plus one fdatasync, against G3 with `disk_fsync`). Each round uses
fresh files; the previous round's are synced and deleted first, so dirty pages do not carry over.

    python bench/kvbm_flush.py [--blocks 2048] [--reps 3] [--fsync] [--disk-path DIR]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kvbm.api import KVLayout  # noqa: E402
from kvbm.block_hash import BlockHash  # noqa: E402
from kvbm.config import GIB, KVBMConfig  # noqa: E402
from kvbm.connector import FLUSH_BATCH, KVBMConnector  # noqa: E402
from kvbm.disk_pool import DiskPool  # noqa: E402
from kvbm.host_pool import HostPool, remove_segments  # noqa: E402

LAYOUT = KVLayout("smollm2-135m|float32|bs16|l30h3d64", 30, 16, 3, 64, torch.float32)
G1_BLOCKS = FLUSH_BATCH
T = TypeVar("T")


def filled_connector(blocks: int, disk: Path, fsync: bool) -> KVBMConnector:
    """A connector whose G2 holds `blocks` blocks (G2 sized 1.5x: none overflowed to G3) and an empty G3."""
    bb = LAYOUT.block_bytes
    config = KVBMConfig(
        host_cache_gb=blocks * 1.5 * bb / GIB, disk_cache_gb=blocks * bb / GIB, disk_path=disk,
        cache_id=f"bench-flush-{uuid.uuid4().hex[:8]}", flush_budget_s=600.0, disk_fsync=fsync,
    )  # fmt: skip
    kvbm = KVBMConnector(config, "bench-worker")
    kvbm.bind(torch.randn(G1_BLOCKS, 30, 2, 16, 3, 64), LAYOUT)
    for start in range(0, blocks, G1_BLOCKS):
        count = min(G1_BLOCKS, blocks - start)
        kvbm.offload([BlockHash(start + i + 1) for i in range(count)], list(range(count)))
    host, disk_pool = (next(t for t in kvbm.tiers if isinstance(t, kind)) for kind in (HostPool, DiskPool))
    if host.used_blocks != blocks or disk_pool.used_blocks != 0:
        raise RuntimeError(
            f"G2 holds {host.used_blocks} blocks and G3 {disk_pool.used_blocks}: sizing is off"
        )
    return kvbm


def timed_close(disk: Path, blocks: int, fsync: bool) -> tuple[float, float, int]:
    """(seconds of close(), seconds of its G3 puts, blocks G3 holds afterwards)."""
    kvbm = filled_connector(blocks, disk, fsync)
    disk_pool = next(t for t in kvbm.tiers if isinstance(t, DiskPool))
    start = time.perf_counter()
    kvbm.close()
    elapsed = time.perf_counter() - start
    put_s = (
        kvbm.metrics.registry.get_sample_value("kvbm_transfer_seconds_sum", {"direction": "G2->G3"}) or 0.0
    )
    remove_segments(kvbm.config.cache_id)
    return elapsed, put_s, disk_pool.used_blocks


def timed_floor(disk: Path, blocks: int, fsync: bool) -> float:
    """Seconds of one sequential write of `blocks` blocks' bytes (page-aligned slots, as G3 lays them out)."""
    stride = -(-LAYOUT.block_bytes // 4096) * 4096
    chunk = np.random.default_rng(0).integers(0, 256, FLUSH_BATCH * stride, dtype=np.uint8)
    fd = os.open(disk / "floor.dat", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, blocks * stride)  # G3 preallocates its file when it is created
        start = time.perf_counter()
        for offset in range(0, blocks, FLUSH_BATCH):
            os.pwrite(fd, chunk[: min(FLUSH_BATCH, blocks - offset) * stride], offset * stride)
        if fsync:
            os.fdatasync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)


def in_fresh_dir(parent: Path | None, measure: Callable[[Path], T]) -> T:
    """`measure(folder)` in a new folder under `parent`, deleted afterwards (the previous round's dirty pages
    are written out first)."""
    os.sync()
    disk = Path(tempfile.mkdtemp(prefix="kvbm-flush-", dir=parent))
    try:
        return measure(disk)
    finally:
        shutil.rmtree(disk)


def run(args: argparse.Namespace) -> dict:
    """Rounds alternate which of close() and the floor goes first, so machine noise hits both alike."""
    closes, puts, floors = [], [], []
    for round_number in range(args.reps):
        ours = partial(
            in_fresh_dir, args.disk_path, partial(timed_close, blocks=args.blocks, fsync=args.fsync)
        )
        floor = partial(
            in_fresh_dir, args.disk_path, partial(timed_floor, blocks=args.blocks, fsync=args.fsync)
        )
        if round_number % 2:
            floors.append(floor())
            close_s, put_s, copied = ours()
        else:
            close_s, put_s, copied = ours()
            floors.append(floor())
        if copied != args.blocks:
            raise RuntimeError(f"G3 holds {copied} of {args.blocks} blocks after close")
        closes.append(close_s)
        puts.append(put_s)
    total = args.blocks * LAYOUT.block_bytes
    close_s, put_s, floor_s = (statistics.median(v) for v in (closes, puts, floors))
    return {
        "bench": "kvbm_flush", "blocks": args.blocks, "block_bytes": LAYOUT.block_bytes, "bytes": total,
        "fsync": args.fsync, "reps": args.reps, "close_s": close_s, "g3_put_s": put_s, "floor_s": floor_s,
        "close_gbps": total / close_s / 1e9, "floor_gbps": total / floor_s / 1e9,
        "close_over_floor": close_s / floor_s, "close_s_all": closes, "floor_s_all": floors,
    }  # fmt: skip


def report(result: dict) -> None:
    fsync = "with fdatasync" if result["fsync"] else "page cache, no fsync"
    print(
        f"G2 -> G3 flush on close: {result['blocks']} blocks x {result['block_bytes']} B = "
        f"{result['bytes'] / GIB:.2f} GiB, G3 {fsync}, median of {result['reps']}"
    )
    print(f"{'what':<34} {'seconds':>8} {'GB/s':>6}")
    rows = [
        ("KVBMConnector.close() (all)", result["close_s"]),
        ("  of which G3 puts", result["g3_put_s"]),
        ("floor: sequential write, same disk", result["floor_s"]),
    ]
    for name, seconds in rows:
        print(f"{name:<34} {seconds:>8.2f} {result['bytes'] / seconds / 1e9:>6.2f}")
    print(f"close() takes {result['close_s'] / result['floor_s']:.2f}x the floor")
    print(json.dumps(result))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=2048, help="blocks in G2 (737,280 B each)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--fsync", action="store_true", help="G3 with disk_fsync (fdatasync per block)")
    parser.add_argument(
        "--disk-path", type=Path, default=None, help="folder for G3 (default: the temp folder)"
    )
    return parser.parse_args()


if __name__ == "__main__":
    report(run(parse_args()))
