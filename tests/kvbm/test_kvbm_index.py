"""KVIndex query correctness against a brute-force reference, worker removal, G4 expiry, G5."""

from __future__ import annotations

import random
import time

from kvbm.block_hash import BlockHash
from kvbm.events import G1, G2, G3, G4, G5, TierEvent
from kvbm.index import KVIndex, PrefixReport, WorkerPrefix


def reference(
    held: dict[tuple[str, int], set[int]], g4: set[int], g5: set[int], query: list[int]
) -> PrefixReport:
    workers = {w for w, _ in held}
    report = PrefixReport(len(query))
    for worker in workers:
        lengths = []
        for tier in (G1, G2, G3):
            length = 0
            for block_hash in query:
                if not any(block_hash in held.get((worker, t), set()) for t in range(G1, tier + 1)):
                    break
                length += 1
            lengths.append(length)
        if lengths[2]:
            report.workers[worker] = WorkerPrefix(*lengths)
    report.g4 = next((i for i, h in enumerate(query) if h not in g4), len(query))
    report.g5 = next((i for i, h in enumerate(query) if h not in g4 | g5), len(query))
    return report


def test_random_events_match_reference() -> None:
    rng = random.Random(7)
    index = KVIndex(max_workers=8)
    held: dict[tuple[str, int], set[int]] = {}
    g4: set[int] = set()
    g5: set[int] = set()
    universe = list(range(1, 40))
    for _ in range(600):
        worker, tier = f"w{rng.randrange(5)}", rng.choice((G1, G2, G3, G4, G5))
        blocks = rng.sample(universe, rng.randrange(1, 6))
        kind = rng.choice(("stored", "stored", "removed", "moved"))
        if kind == "moved" and tier not in (G4, G5):
            source = rng.choice([t for t in (G1, G2, G3) if t != tier])
            index.apply(TierEvent(worker, "moved", tier, tuple(map(BlockHash, blocks)), from_tier=source))
            held.setdefault((worker, source), set()).difference_update(blocks)
            held.setdefault((worker, tier), set()).update(blocks)
            continue
        kind = "stored" if kind == "moved" else kind
        index.apply(TierEvent(worker, kind, tier, tuple(map(BlockHash, blocks))))
        target = g4 if tier == G4 else g5 if tier == G5 else held.setdefault((worker, tier), set())
        (target.update if kind == "stored" else target.difference_update)(blocks)
        query = [BlockHash(h) for h in rng.sample(universe, 12)]
        assert index.query(query) == reference(held, g4, g5, query)


def test_removed_worker_vanishes_at_once_and_slot_is_reused() -> None:
    index = KVIndex(max_workers=2)
    index.apply(TierEvent("a", "stored", G1, (BlockHash(1), BlockHash(2))))
    index.apply(TierEvent("b", "stored", G2, (BlockHash(1),)))
    index.remove_worker("a")
    assert index.query([BlockHash(1), BlockHash(2)]).workers == {"b": WorkerPrefix(0, 1, 1)}
    index.apply(TierEvent("c", "stored", G3, (BlockHash(2),)))  # needs a slot: sweeps a's bits first
    report = index.query([BlockHash(1), BlockHash(2)])
    assert report.workers == {"b": WorkerPrefix(0, 1, 1)}
    assert index.query([BlockHash(2)]).workers == {"c": WorkerPrefix(0, 0, 1)}
    assert len(index) == 2


def test_removed_event_of_forgotten_worker_is_ignored() -> None:
    index = KVIndex()
    index.apply(TierEvent("gone", "removed", G2, (BlockHash(1),)))
    assert index.workers == []


def test_g4_prefix_is_for_anyone_and_expires() -> None:
    index = KVIndex()
    index.apply(TierEvent("a", "stored", G4, (BlockHash(1), BlockHash(2))))
    index.apply(TierEvent("b", "stored", G4, (BlockHash(3),), ttl_s=1, timestamp=time.time() - 2))
    report = index.query([BlockHash(1), BlockHash(2), BlockHash(3)])
    assert report.g4 == 2 and report.workers == {}


def test_channel_coalesces_runs_of_similar_events() -> None:
    from kvbm.channel import coalesce

    events = [TierEvent("w", "stored", G1, (BlockHash(h),), timestamp=1.0) for h in (1, 2, 3)]
    events.append(TierEvent("w", "removed", G1, (BlockHash(1),)))
    merged = coalesce(events)
    assert [(e.kind, e.block_hashes) for e in merged] == [("stored", (1, 2, 3)), ("removed", (1,))]


def test_g2_blocks_of_a_node_count_for_every_worker_on_it() -> None:
    index = KVIndex()
    chain = (BlockHash(1), BlockHash(2))
    index.apply(TierEvent("b", "stored", G1, (BlockHash(9),), node="host1:seg"))  # b joins host1
    index.apply(TierEvent("c", "stored", G1, (BlockHash(9),), node="host2:seg"))
    index.apply(TierEvent("a", "stored", G2, chain, node="host1:seg"))
    report = index.query(list(chain))
    assert report.workers == {"a": WorkerPrefix(0, 2, 2), "b": WorkerPrefix(0, 2, 2)}
    index.remove_worker("a")  # its G2 blocks stay in the segment, still usable by b
    assert index.query(list(chain)).workers == {"b": WorkerPrefix(0, 2, 2)}
    index.apply(TierEvent("a", "removed", G2, chain[1:], node="host1:seg"))  # evicted by b, owned by a
    assert index.query(list(chain)).workers == {"b": WorkerPrefix(0, 1, 1)}
    index.apply(TierEvent("b", "moved", G3, chain[:1], from_tier=G2, node="host1:seg"))
    assert index.query(list(chain)).workers == {"b": WorkerPrefix(0, 0, 1)}
