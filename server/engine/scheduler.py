"""Continuous batching: which sequences compute how many tokens in the next step.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first, oldest first: a decoding
sequence takes 1 token, a sequence still in its prompt takes the next chunk. If the pool cannot hold a running
sequence's next tokens, the newest running sequence is preempted (blocks freed, recomputed later from its tokens;
its full blocks stay in the prefix cache, so the recompute is mostly a cache hit). Waiting sequences are admitted,
in arrival order, while the budget, `max_concurrent_requests` and the pool allow, and never in a step that preempted.

Under the priority policy (`by_priority`, vLLM's `--scheduling-policy priority`) both queues are ordered by
(priority, arrival), lower first: the best waiting sequence is admitted first, the worst running one is preempted
first, and a waiting sequence of strictly better priority that finds the batch full (max_concurrent_requests, or no
room in the pool for its first chunk) preempts the worst running ones until it fits. A preempted sequence resumes
later from its tokens, so it finishes with the same answer; equal priorities never preempt each other.

A waiting sequence whose first uncached block is being computed by a running sequence (two turns of one
conversation, or n requests with one prompt, arriving together) waits: once that block is registered it is a
prefix hit, instead of the same prefix being prefilled twice in the same steps. Sequences behind it are admitted
meanwhile; the wait lasts only while the block's owner runs.

A sequence whose own scheduling work raises (growing its block table, its admission: prefix lookup, a handoff
read, an onboard from a lower tier) is left where it is and reported in `SchedulerOutput.failed`, for the core to
fail and remove; the other sequences are scheduled as if it were not there.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass

from kvbm.block_hash import BlockHash
from server.engine.block_manager import BlockManager
from server.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at its `num_computed_tokens`, computed this step."""

    seq: Sequence
    num_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: the chunks to compute, in order, and the sequences whose scheduling raised."""

    chunks: list[ScheduledChunk]
    failed: list[tuple[Sequence, Exception]]


def _rank(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.arrival


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_concurrent: int,
        by_priority: bool = False,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_concurrent = max_concurrent
        self.by_priority = by_priority
        self._arrivals = itertools.count()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefix_waits = (
            0  # times (per step) a waiting sequence was held back for a prefix being computed
        )
        self.wait_for_running_prefix = True  # bench/engine.py turns it off for its baseline

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.block_manager.touch(self.block_manager.match_prefix(seq))  # keep it cached while seq waits
        seq.arrival = next(self._arrivals)
        if self.by_priority:
            self.waiting.insert(bisect.bisect_right(self.waiting, _rank(seq), key=_rank), seq)
        else:
            self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [])
        if self.by_priority:
            self._make_room_for_priority()
        budget, preempted = self._schedule_running(out, self.max_num_batched_tokens)
        if not preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Running sequences first, oldest first, preempting the newest when the pool is short. Returns the
        budget left and whether anything was preempted."""
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            try:
                while not self.block_manager.grow(seq, seq.num_computed_tokens + num_tokens):
                    preempted = True
                    self.preempt(self.running.pop())
                    if seq.status is SequenceStatus.WAITING:
                        break
            except Exception as err:
                out.failed.append((seq, err))
                index += 1
                continue
            if seq.status is SequenceStatus.WAITING:
                break
            out.chunks.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
            index += 1
        return budget, preempted

    def _make_room_for_priority(self) -> None:
        """Preempt the worst running sequences while the best waiting one is of strictly better priority and finds
        the batch full: max_concurrent reached, or too few blocks for its first chunk."""
        manager = self.block_manager
        while self.waiting and self.running and self.running[-1].priority > self.waiting[0].priority:
            head = self.waiting[0]
            if len(self.running) < self.max_concurrent:
                hits = manager.match_prefix(head)
                first_chunk = min(head.num_tokens, self.max_num_batched_tokens)
                needed = -(-first_chunk // manager.block_size) - len(hits)
                if manager.num_allocatable(hits) >= needed + len(self.running):  # + a decode block each
                    return
            self.preempt(self.running.pop())

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in arrival order while the budget, max_concurrent and the pool allow."""
        in_progress = self._blocks_in_progress() if self.waiting and self.wait_for_running_prefix else set()
        index = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_concurrent:
            seq = self.waiting[index]
            try:
                if in_progress and self._waits_for(seq, in_progress):
                    self.num_prefix_waits += 1
                    index += 1
                    continue
                num_tokens = self._admit(seq, budget)
            except Exception as err:
                out.failed.append((seq, err))
                index += 1
                continue
            if num_tokens == 0:
                break
            del self.waiting[index]
            seq.status = SequenceStatus.RUNNING
            if seq.trace is not None:
                seq.trace.admitted(seq.num_computed_tokens)
            if self.by_priority:  # the worst last: the one preempted first
                self.running.insert(bisect.bisect_right(self.running, _rank(seq), key=_rank), seq)
            else:
                self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
            if self.wait_for_running_prefix:
                in_progress.update(seq.block_hashes[seq.num_registered_blocks :])

    def _blocks_in_progress(self) -> set[BlockHash]:
        """Hashes of full blocks that running sequences hold but have not yet computed and registered."""
        return {
            block_hash for seq in self.running for block_hash in seq.block_hashes[seq.num_registered_blocks :]
        }

    def _waits_for(self, seq: Sequence, in_progress: set[BlockHash]) -> bool:
        """True if the first block of `seq` missing from the prefix cache is one a running sequence computes."""
        cached = self.block_manager.cached
        for block_hash in seq.block_hashes[: seq.num_reusable_blocks]:  # as match_prefix
            if block_hash not in cached:
                return block_hash in in_progress
        return False

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Take the sequence's cached prefix (G1, then a prefill worker's handoff, then lower tiers) and room for its
        first chunk; 0 if no room."""
        manager, block_size = self.block_manager, self.block_manager.block_size
        hits = manager.match_prefix(seq)
        room = manager.num_allocatable(hits)
        manager.take(seq, hits)
        received, complete = manager.receive(seq, len(hits), max_blocks=room - 1)
        onboarded = (
            manager.onboard(seq, len(hits) + received, max_blocks=room - 1 - received) if complete else 0
        )
        seq.num_computed_tokens = (len(hits) + received + onboarded) * block_size
        if seq.num_output_tokens == 0:  # a recompute after preemption does not change what the client sees
            seq.num_cached_tokens = seq.num_computed_tokens
        capacity = (len(seq.block_table) + manager.num_free_blocks) * block_size
        num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget, capacity - seq.num_computed_tokens)
        if num_tokens <= 0 or not manager.grow(seq, seq.num_computed_tokens + num_tokens):
            manager.free(seq)
            seq.num_computed_tokens = 0
            return 0
        return num_tokens

    def preempt(self, seq: Sequence) -> None:
        """Free a sequence no longer in `running` and put it first in the wait queue (by its rank under the priority
        policy): it is recomputed from its tokens when admitted again (its registered blocks are likely still
        cached)."""
        self.block_manager.free(seq)
        if seq.trace is not None:
            seq.trace.preempted(seq.num_computed_tokens)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        if self.by_priority:
            self.waiting.insert(bisect.bisect_left(self.waiting, _rank(seq), key=_rank), seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from whichever queue holds it and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif (
            seq.status is SequenceStatus.WAITING and seq in self.waiting
        ):  # not yet added: its KV is fetching
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
