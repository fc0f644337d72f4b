"""Priority scheduling (vLLM's `--scheduling-policy priority`: lower `priority` runs first): the scheduler's order
and preemption on a bare block manager, then the real engine, saturated: a priority-0 request sent after
priority-10 ones finishes first, and the ones it preempted finish with the tokens they have alone (greedy)."""

from __future__ import annotations

import queue

import msgspec
import pytest
from conftest import engine_config, greedy, run

from kvbm.block_hash import model_salt
from server.engine.api import GenerationRequest, RequestError, RequestId, SamplingParams
from server.engine.block_manager import BlockManager
from server.engine.detokenizer import Detokenizer
from server.engine.llm_engine import LLMEngine
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence, SequenceStatus

_NAMES: dict[str, int] = {}


def seq(name: str, priority: int, tokens: int = 8) -> Sequence:
    """A sequence of `tokens` prompt tokens that shares no block with another name's."""
    start = _NAMES.setdefault(name, len(_NAMES) * 1000)
    return Sequence(
        RequestId(name), list(range(start, start + tokens)), tokens,
        SamplingParams(), lambda o: None, Detokenizer(None, []), 4, model_salt("test"), priority=priority,
    )  # fmt: skip


def step(scheduler: Scheduler) -> list[str]:
    """One schedule, computed as the engine would; the ids scheduled."""
    chunks = scheduler.schedule().chunks
    for chunk in chunks:
        chunk.seq.num_computed_tokens += chunk.num_tokens
        scheduler.block_manager.register_full_blocks(chunk.seq)
    return [chunk.seq.request_id for chunk in chunks]


def test_a_better_priority_waits_first_and_takes_the_place_of_the_worst_running_one() -> None:
    scheduler = Scheduler(BlockManager(num_blocks=64, block_size=4), 64, max_concurrent=2, by_priority=True)
    low_a, low_b, mid = seq("low_a", 10), seq("low_b", 10), seq("mid", 5)
    for s in (low_a, low_b):
        scheduler.add(s)
    assert step(scheduler) == ["low_a", "low_b"]
    high, late_low = seq("high", 0), seq("late_low", 10)
    for s in (late_low, mid, high):
        scheduler.add(s)
    assert [s.request_id for s in scheduler.waiting] == ["high", "mid", "late_low"]
    assert "high" in step(scheduler)  # the batch was full: low_b (worst: latest of the lowest) made room
    assert low_b.status is SequenceStatus.WAITING and low_a.status is SequenceStatus.RUNNING
    assert [s.request_id for s in scheduler.waiting] == ["mid", "low_b", "late_low"]  # low_b keeps its turn
    assert "mid" in step(scheduler) and low_a.status is SequenceStatus.WAITING
    assert scheduler.num_preemptions == 2
    assert step(scheduler) == ["high", "mid"]  # equal or worse priorities never preempt


def test_a_better_priority_preempts_when_the_pool_has_no_room() -> None:
    scheduler = Scheduler(BlockManager(num_blocks=6, block_size=4), 64, max_concurrent=8, by_priority=True)
    low = seq("low", 10, tokens=16)
    scheduler.add(low)
    assert step(scheduler) == ["low"]  # 4 of 6 blocks
    high = seq("high", 0, tokens=12)
    scheduler.add(high)
    assert step(scheduler) == ["high"] and low.status is SequenceStatus.WAITING


def test_fcfs_keeps_arrival_order_whatever_the_priority() -> None:
    scheduler = Scheduler(BlockManager(num_blocks=64, block_size=4), 64, max_concurrent=1)
    first, high = seq("first", 10), seq("high", 0)
    scheduler.add(first)
    scheduler.add(high)
    assert step(scheduler) == ["first"] and list(scheduler.waiting) == [high]


def test_an_fcfs_engine_refuses_a_priority_by_name(engine: LLMEngine, prompt_ids) -> None:
    with pytest.raises(RequestError) as raised:
        engine.submit(msgspec.structs.replace(greedy(prompt_ids[0], "prio"), priority=3), lambda o: None)
    assert raised.value.field == "priority"


@pytest.mark.slow
def test_under_a_saturated_engine_priority_zero_finishes_first_and_preempted_ones_lose_nothing(
    prompt_ids,
) -> None:
    config = engine_config(max_concurrent_requests=2, scheduling_policy="priority")
    with LLMEngine(config) as engine:
        lows = [greedy(ids, f"low{i}", max_tokens=16) for i, ids in enumerate(prompt_ids[:3])]
        alone = {r.request_id: run(engine, r).new_token_ids for r in lows}
        finished: list[str] = []
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        for r in lows:
            engine.submit(
                GenerationRequest(r.request_id, r.prompt_token_ids, r.sampling, priority=10), outputs.put
            )
        tokens: dict[str, list[int]] = {r.request_id: [] for r in lows}
        started = set()
        while len(started) < 2:  # both batch places taken by priority-10 requests
            output = outputs.get(timeout=120)
            tokens[output.request_id].extend(output.new_token_ids)
            started.add(output.request_id)
        high = greedy(prompt_ids[4], "high", max_tokens=8)
        engine.submit(
            GenerationRequest(high.request_id, high.prompt_token_ids, high.sampling, priority=0), outputs.put
        )
        tokens["high"] = []
        while len(finished) < len(lows) + 1:
            output = outputs.get(timeout=300)
            assert output.finish_reason != "error", output.error
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finished:
                finished.append(output.request_id)
        assert finished[0] == "high", finished
        assert engine.stats().num_preemptions >= 1
        for request_id, expected in alone.items():
            assert tokens[request_id] == expected, request_id
