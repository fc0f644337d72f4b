"""Block manager invariants (LRU reuse, collision guard, events) and the KV connector hooks (offload/onboard)."""

from __future__ import annotations

import torch
from conftest import engine_config, greedy, run

from kvbm.api import BlockRemoved, BlockStored
from kvbm.block_hash import BlockHash, model_salt
from server.engine.api import RequestId, SamplingParams
from server.engine.block_manager import BlockManager
from server.engine.detokenizer import Detokenizer
from server.engine.llm_engine import LLMEngine
from server.engine.sequence import Sequence


class RecordingConnector:
    """A G2 stand-in: keeps offloaded blocks in a dict, serves them back on onboard."""

    def __init__(self) -> None:
        self.store: dict[BlockHash, torch.Tensor] = {}
        self.events: list = []
        self.onboarded = 0

    def bind(self, kv_cache, layout) -> None:
        self.kv_cache, self.layout = kv_cache, layout

    def lookup(self, block_hashes) -> int:
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.store:
                break
            count += 1
        return count

    def onboard(self, block_hashes, block_ids, reads=None) -> int:
        for block_hash, block_id in zip(block_hashes, block_ids, strict=True):
            self.kv_cache[block_id].copy_(self.store[block_hash])
        self.onboarded += len(block_ids)
        return len(block_ids)

    def offload(self, block_hashes, block_ids) -> None:
        for block_hash, block_id in zip(block_hashes, block_ids, strict=True):
            self.store[block_hash] = self.kv_cache[block_id].clone()

    def on_event(self, event) -> None:
        self.events.append(event)

    def close(self) -> None:
        self.closed = True


def make_seq(tokens: list[int], block_size: int = 4) -> Sequence:
    return Sequence(
        RequestId("s"), list(tokens), len(tokens), SamplingParams(), lambda o: None, Detokenizer(None, []),
        block_size, model_salt("test"),
    )  # fmt: skip


def computed(manager: BlockManager, seq: Sequence) -> Sequence:
    manager.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.register_full_blocks(seq)
    return seq


def test_freed_blocks_stay_cached_and_tail_is_evicted_first():
    connector = RecordingConnector()
    connector.kv_cache = torch.zeros(6, 1)
    manager = BlockManager(num_blocks=6, block_size=4, connector=connector)
    seq = computed(manager, make_seq(list(range(13))))  # 3 full blocks + 1 partial
    assert manager.num_cached_blocks == 3 and manager.num_free_blocks == 2
    assert [type(e) for e in connector.events] == [BlockStored] * 3
    manager.free(seq)
    assert manager.num_free_blocks == 6 and manager.num_cached_blocks == 3
    again = make_seq(list(range(13)))
    assert len(manager.match_prefix(again)) == 3
    other = make_seq([100 + i for i in range(13)])
    manager.grow(other, 13)  # needs 4: the unhashed partial block, 2 never-used, then the prefix tail
    removed = [e for e in connector.events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved((seq.block_hashes[2],))]
    assert len(manager.match_prefix(again)) == 2


def test_hash_collision_is_a_miss():
    manager = BlockManager(num_blocks=4, block_size=4)
    seq = computed(manager, make_seq(list(range(9))))
    manager.free(seq)
    forged = make_seq([7, 7, 7, 7, 8])
    forged.block_hashes[0] = seq.block_hashes[0]  # same hash, different tokens
    assert manager.match_prefix(forged) == []


def test_last_token_is_never_a_cache_hit():
    manager = BlockManager(num_blocks=4, block_size=4)
    seq = computed(manager, make_seq(list(range(8))))
    manager.free(seq)
    assert len(manager.match_prefix(make_seq(list(range(8))))) == 1


def test_evicted_blocks_are_offloaded_and_onboarded_with_identical_output(prompt_ids):
    connector = RecordingConnector()
    long_ids = prompt_ids[13]  # ~300 tokens, 19+ full blocks
    small = LLMEngine(engine_config(num_kv_blocks=-(-len(long_ids) // 16) + 4), connector=connector)
    try:
        assert connector.layout.fingerprint == small.layout.fingerprint
        assert "fp32" in small.layout.fingerprint or "float32" in small.layout.fingerprint
        first = run(small, greedy(long_ids, "first"))
        for index in (12, 19):  # other long prompts push the first one's blocks out of G1
            run(small, greedy(prompt_ids[index], f"evict-{index}"))
        assert connector.store, "eviction did not offload"
        assert any(isinstance(e, BlockRemoved) for e in connector.events)
        again = run(small, greedy(long_ids, "again"))
        assert connector.onboarded > 0
        assert again.num_cached_tokens >= connector.onboarded * 16
        assert again.new_token_ids == first.new_token_ids
        assert small.stats().num_free_blocks == small.stats().num_blocks
    finally:
        small.close()


def test_failing_connector_counts_as_miss(prompt_ids):
    class Broken(RecordingConnector):
        def lookup(self, block_hashes) -> int:
            raise ConnectionError("tier down")

        def offload(self, block_hashes, block_ids) -> None:
            raise ConnectionError("tier down")

    engine = LLMEngine(engine_config(num_kv_blocks=40), connector=Broken())
    try:
        for index in (13, 12, 13):
            output = run(engine, greedy(prompt_ids[index], f"b-{index}"))
            assert output.finish_reason in ("stop", "length")
    finally:
        engine.close()


def test_waiting_sequence_waits_for_the_prefix_a_running_one_computes():
    """B shares A's first 3 blocks and arrives with it: B waits one step (C behind it is admitted), then hits."""
    from server.engine.scheduler import Scheduler
    from server.engine.sequence import SequenceStatus

    manager = BlockManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(manager, max_num_batched_tokens=64, max_concurrent=8)
    a, b, c = (
        make_seq(list(range(14))),
        make_seq(list(range(12)) + [50, 51, 52]),
        make_seq(list(range(100, 110))),
    )
    for seq in (a, b, c):
        scheduler.add(seq)
    first = scheduler.schedule().chunks
    assert [chunk.seq for chunk in first] == [a, c] and list(scheduler.waiting) == [b]
    for chunk in first:  # what the engine does after the step
        chunk.seq.num_computed_tokens += chunk.num_tokens
        manager.register_full_blocks(chunk.seq)
    second = scheduler.schedule().chunks
    assert second[-1].seq is b and b.status is SequenceStatus.RUNNING
    assert b.num_cached_tokens == 12 and second[-1].num_tokens == 3
    assert scheduler.num_prefix_waits == 1


def test_requests_arriving_together_share_their_prefix(engine, prompt_ids):
    """Two turns of one conversation submitted at once: the second reuses the first's prompt blocks instead of
    prefilling them in the same steps, and both answers are the ones each gets alone."""
    import queue

    base = prompt_ids[13]
    follow_up = base + prompt_ids[1]
    alone = [run(engine, greedy(ids, f"alone-{i}")).new_token_ids for i, ids in enumerate((base, follow_up))]
    fresh = LLMEngine(engine_config(num_kv_blocks=120))  # an empty prefix cache
    try:
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        for i, ids in enumerate((base, follow_up)):
            fresh.submit(greedy(ids, f"together-{i}"), outputs.put)
        tokens, cached, finished = {0: [], 1: []}, {}, 0
        while finished < 2:
            output = outputs.get(timeout=300)
            index = int(output.request_id.rsplit("-", 1)[1])
            tokens[index].extend(output.new_token_ids)
            cached[index] = output.num_cached_tokens
            finished += output.finished
        assert cached[0] == 0
        assert cached[1] >= (len(base) // 16 - 1) * 16, cached
        assert [tokens[0], tokens[1]] == alone
        assert fresh.scheduler.num_prefix_waits >= 1
    finally:
        fresh.close()


def test_a_queued_request_keeps_its_cached_prefix_while_others_evict():
    """X's prefix is the oldest free one when X queues; allocations for requests ahead of it evict others."""
    from server.engine.scheduler import Scheduler

    manager = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(manager, max_num_batched_tokens=64, max_concurrent=8)
    older = computed(manager, make_seq(list(range(13))))  # 3 full blocks + a partial one
    newer = computed(manager, make_seq([100 + i for i in range(13)]))
    manager.free(older)
    manager.free(newer)
    queued = make_seq(list(range(12)) + [99])
    scheduler.add(queued)
    manager.grow(make_seq([200 + i for i in range(20)]), 20)  # 5 blocks: the 2 partial ones, then 3 cached
    assert len(manager.match_prefix(queued)) == 3
    assert manager.match_prefix(make_seq([100 + i for i in range(13)])) == []
