"""Run under the vLLM venv by test_vllm_kvbm.py: one VLLMEngine with Strata's KV tiers (G2 only), a G1 pool of a
few blocks, and the tier events it publishes kept in a list. Prints one JSON line of what happened.

With a folder as third argument: G3 only in that folder, and one block of the prompt corrupted on disk before it
is asked again (the load stops at it; vLLM recomputes). With a Redis URL as third argument: the engine has no event list but that Redis (the standalone KVBM service's
mode), a `KVBMService` follows it here, and the service is then restarted on an emptied Redis; the line says what
the service's index held for the worker before and after (the worker announces again on the new epoch). With an
s3:// URL as third argument (the AWS_* environment pointing at the store): G5 only; a first engine answers the
prompt and closes, a second one (nothing of the first in memory) answers it from the bucket."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from pathlib import Path

from harness.waiting import wait_for
from kvbm.block_hash import block_hashes, request_salt
from kvbm.config import KVBMConfig
from kvbm.events import G1, G2, G3
from kvbm.signing import BLOCK_KEY_PURPOSE
from server.engine.api import GenerationOutput, GenerationRequest, SamplingParams
from server.vllm_engine.engine import VLLMEngine

DOCUMENTS = [f"Document {i}: " + f"Topic {i} is about serving systems and KV caches. " * 55 for i in range(5)]


class EventList:
    def __init__(self) -> None:
        self.events = []

    def publish(self, event) -> None:
        self.events.append(event)

    def hashes(self, tier: int, kind: str) -> set[int]:
        return {h for e in self.events if e.tier == tier and e.kind == kind for h in e.block_hashes}

    def held(self, tier: int) -> set[int]:
        """The blocks `tier` holds now by the events so far, in order (G2 is set-associative: a full set
        evicts a block even while the pool has room, and its "removed" event follows its "stored" one)."""
        held: set[int] = set()
        for event in self.events:
            if event.tier == tier and event.kind == "stored":
                held.update(event.block_hashes)
            elif event.tier == tier and event.kind == "removed":
                held.difference_update(event.block_hashes)
        return held


def generate(
    engine: VLLMEngine, request_id: str, prompt_ids: list[int], cache_salt: str | None = None
) -> dict:
    done, result = threading.Event(), {"token_ids": []}

    def sink(output: GenerationOutput) -> None:
        result["token_ids"] += output.new_token_ids
        result["cached_tokens"] = output.num_cached_tokens
        if output.finished:
            result["error"] = output.error
            done.set()

    sampling = SamplingParams(max_tokens=8, temperature=0)
    engine.submit(GenerationRequest(request_id, prompt_ids, sampling, cache_salt=cache_salt), sink)
    assert done.wait(300), f"{request_id} did not finish"
    return result


def announce(engine: VLLMEngine, events: EventList) -> dict:
    """What `engine.announce()` publishes again, against what the events said G2 held before it. The wait ends
    when every held block was announced (a late event of the last request must not end it early)."""
    g1_stored, g2_held = events.hashes(G1, "stored"), events.held(G2)
    before = len(events.events)
    engine.announce()

    def announced(tier: int) -> set[int]:
        return {
            h for e in events.events[before:] if e.tier == tier and e.kind == "stored" for h in e.block_hashes
        }

    # the announcement's events arrive on the relay's thread, one by one: polled, with a deadline; what came by
    # then is reported and the test judges it
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: g2_held <= announced(G2), 10, 0.05, what="every held G2 block announced")
    g1, g2 = announced(G1), announced(G2)
    return {
        "g1": len(g1),
        "g1_known": g1 <= g1_stored,
        "g2": len(g2),
        "g2_all": g2 == g2_held,
        "g2_held": len(g2_held),
    }


def main() -> None:
    model_folder, cache_id = sys.argv[1], sys.argv[2]
    events = EventList()
    args = {
        "model": model_folder, "enforce_eager": True, "dtype": "float32", "max_model_len": 1024,
        "kv_cache_memory_bytes": 80 << 20,  # 14 blocks of 128 tokens: five 720-token prompts do not fit
    }  # fmt: skip
    kvbm = KVBMConfig(host_cache_gb=0.25, cache_id=cache_id, flush_budget_s=0)
    engine = VLLMEngine(args, worker_id="check-w0", events=events, kvbm=kvbm)
    try:
        prompts = [engine.encode(text) for text in DOCUMENTS]
        layout = engine.block_layout
        hashes = block_hashes(prompts[0], layout.block_size, layout.salt)
        report = {"prompt_tokens": len(prompts[0]), "first": generate(engine, "a-1", prompts[0])}
        for i, prompt in enumerate(prompts[1:]):
            generate(engine, f"fill-{i}", prompt)
        report["evicted_from_g1"] = hashes[0] in events.hashes(G1, "removed")
        report["in_g2"] = len(set(hashes) & events.hashes(G2, "stored"))
        report["again"] = generate(engine, "a-2", prompts[0])
        report["salted"] = generate(engine, "a-3", prompts[0], cache_salt="tenant-1")
        salted = block_hashes(prompts[0], layout.block_size, request_salt(layout.salt, "tenant-1"))
        report["salted_in_g2"] = len(set(salted) & events.hashes(G2, "stored"))
        report["announce"] = announce(engine, events)
    finally:
        engine.close()
    print(json.dumps(report))


def service_main() -> None:
    model_folder, cache_id, redis_url = sys.argv[1:4]
    import redis

    from cluster.secret import derive_key
    from kvbm.service import KVBMService

    args = {"model": model_folder, "enforce_eager": True, "dtype": "float32", "max_model_len": 1024,
            "kv_cache_memory_bytes": 80 << 20}  # fmt: skip
    block_key = derive_key(
        b"kvbm-check cluster secret, 32 by", BLOCK_KEY_PURPOSE
    )  # Redis is G4 too: its blocks are signed
    kvbm = KVBMConfig(
        host_cache_gb=0.25, cache_id=cache_id, redis_url=redis_url, flush_budget_s=0, block_key=block_key
    )
    service = KVBMService(redis_url, port=None, lease_check_s=0.2).start()
    engine = VLLMEngine(args, worker_id="svc-w0", events=None, kvbm=kvbm)
    report = {}
    try:
        prompt = engine.encode(DOCUMENTS[0])
        hashes = block_hashes(prompt, engine.block_layout.block_size, engine.block_layout.salt)
        generate(engine, "s-1", prompt)

        def held(service: KVBMService) -> list[int]:
            """What the service's index holds for the worker once its G2 holds every block (events reach the
            service through Redis: polled, with a deadline), or when the deadline passed."""

            def prefix():
                return service.index.query(hashes).workers.get("svc-w0")

            with contextlib.suppress(TimeoutError):
                wait_for(
                    lambda: (p := prefix()) is not None and p.g2 == len(hashes), 10, 0.05, what="G2 indexed"
                )
            found = prefix()
            return [found.g1, found.g2] if found is not None else []

        report["full_blocks"] = len(hashes)
        report["before"] = held(service)
        service.stop()
        redis.Redis.from_url(redis_url).flushall()  # the stream is gone: only an announcement can rebuild it
        service = KVBMService(redis_url, port=None, lease_check_s=0.2).start()
        report["after_restart"] = held(service)
    finally:
        engine.close()
        service.stop()
    print(json.dumps(report))


def corrupt_main() -> None:
    """G3 only; after the prompt left vLLM's pool, its third block's bytes on disk are overwritten: the load
    stops there (checksum), vLLM recomputes from that block on, and the answer is unchanged."""
    model_folder, disk_path = sys.argv[1], Path(sys.argv[3])
    import numpy as np

    from kvbm.disk_pool import PAGE, RECORD

    events = EventList()
    args = {"model": model_folder, "enforce_eager": True, "dtype": "float32", "max_model_len": 1024,
            "kv_cache_memory_bytes": 80 << 20}  # fmt: skip
    kvbm = KVBMConfig(host_cache_gb=0, disk_cache_gb=0.25, disk_path=str(disk_path), flush_budget_s=0)
    engine = VLLMEngine(args, worker_id="g3-w0", events=events, kvbm=kvbm)
    try:
        prompts = [engine.encode(text) for text in DOCUMENTS]
        layout = engine.block_layout
        hashes = block_hashes(prompts[0], layout.block_size, layout.salt)
        report = {"prompt_tokens": len(prompts[0]), "first": generate(engine, "c-1", prompts[0])}
        for i, prompt in enumerate(prompts[1:]):
            generate(engine, f"fill-{i}", prompt)
        report["evicted_from_g1"] = hashes[0] in events.hashes(G1, "removed")
        report["in_g3"] = len(set(hashes) & events.hashes(G3, "stored"))
        folder = next(disk_path.rglob("index.dat")).parent
        records = np.fromfile(folder / "index.dat", dtype=RECORD, offset=PAGE)
        slot = int(np.flatnonzero(records["hash"] == np.uint64(hashes[2]))[0])
        stride = -(-int(records["length"][slot]) // PAGE) * PAGE
        with open(folder / "blocks.dat", "r+b") as blocks:
            blocks.seek(slot * stride)
            blocks.write(b"\x5a" * PAGE)  # one page of the block: its checksum no longer matches
        report["again"] = generate(engine, "c-2", prompts[0])
    finally:
        engine.close()
    print(json.dumps(report))


def object_main() -> None:
    model_folder, object_url = sys.argv[1], sys.argv[3]
    from cluster.secret import derive_key

    args = {"model": model_folder, "enforce_eager": True, "dtype": "float32", "max_model_len": 1024,
            "kv_cache_memory_bytes": 80 << 20}  # fmt: skip
    block_key = derive_key(b"kvbm-check cluster secret, 32 by", BLOCK_KEY_PURPOSE)
    kvbm = KVBMConfig(host_cache_gb=0, object_url=object_url, block_key=block_key)
    report = {}
    for name in ("first", "again"):
        events = EventList()
        engine = VLLMEngine(args, worker_id=f"s3-{name}", events=events, kvbm=kvbm)
        try:
            prompt = engine.encode(DOCUMENTS[0])
            report["prompt_tokens"] = len(prompt)
            report[name] = generate(engine, name, prompt)
        finally:
            engine.close()  # drains the uploads
        report[f"{name}_g5_stored"] = len(events.hashes(5, "stored"))
    print(json.dumps(report))


if __name__ == "__main__":
    if len(sys.argv) == 3:
        main()
    elif sys.argv[3].startswith("redis"):
        service_main()
    elif sys.argv[3].startswith("s3://"):
        object_main()
    else:
        corrupt_main()
