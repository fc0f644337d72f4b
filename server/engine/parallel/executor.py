"""A sharded worker as the engine core sees it: a `ModelExecutor` and a `KVConnector` over a group of ranks.

The core stays as it is: it schedules, asks the executor for logits and samples on the driver. `ShardedExecutor`
builds the step's inputs once (the driver's `ModelRunner._prepare`), sends them to every rank, computes the
driver's own part, and joins the logits the last stage's ranks send back. It owns its group's life: it reports a
failure, restarts the group with backoff in `recover` and counts the restarts (the events are in
server/engine/executor.py). `ShardedConnector` gives every rank's tiers the same KV operation: each rank holds its
part of a block in tiers keyed by its part's layout (`ShardPlan.tag`), and a block is only as available as its
scarcest part.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch

from cluster.backoff import Backoff
from kvbm.api import BlockEvent, KVConnector, KVLayout, TierRead
from kvbm.block_hash import BlockHash
from server import tracing
from server.engine.api import RankStats, shard_layout
from server.engine.executor import (
    ExecutorEvent,
    ExecutorFailure,
    Failed,
    FailureReason,
    Ready,
    RestartFailed,
    Restarting,
)
from server.engine.model_runner import ModelRunner
from server.engine.parallel import wire
from server.engine.parallel.comm import GroupComm
from server.engine.parallel.group import RankGroup, resident_bytes
from server.engine.parallel.plan import ShardPlan
from server.engine.parallel.stage import StageRunner
from server.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)
FIRST_RETRY_S, LAST_RETRY_S = 1.0, 30.0  # the waits after failed restarts: doubling from first to last


class ShardedExecutor:
    """Implements `server.engine.executor.ModelExecutor` on the driver (rank 0) of worker `worker_id`'s group;
    `on_event` gets its events (`Failed` from the group's monitor as well)."""

    def __init__(
        self, runner: ModelRunner, group: RankGroup, plan: ShardPlan, collective_timeout_s: float, worker_id: str,
        on_event: Callable[[ExecutorEvent], None],
    ) -> None:  # fmt: skip
        self.runner = runner  # the driver's part: its layers and KV heads, its pool rows
        self.group = group
        self.plan = plan
        self._timeout_s = collective_timeout_s
        self._worker_id = worker_id
        self._on_event = on_event
        self.stage: StageRunner | None = None
        self._restarts: dict[str, int] = {}  # Failed.label -> restarts it caused

    @property
    def shard_layout(self) -> str:
        return shard_layout(self.plan.tp_size, self.plan.pp_size)

    def start(self) -> None:
        """Wait for the spawned ranks, then join the collectives (engine thread). ExecutorFailure if it fails."""
        store = self.group.join()
        try:
            comm = GroupComm(store, self.plan, self.runner.device, self._timeout_s, self.group.driver_shm)
        except RuntimeError as err:  # a rank died while the group formed
            detail = f"joining the group failed: {err}"
            raise self.group.fail(Failed(FailureReason.START_FAILED, 0, detail)) from err
        self.runner.model.join_group(comm.all_reduce)
        self.stage = StageRunner(self.runner.model, self.runner.kv_cache, comm, self.plan)

    def recover(self) -> None:
        """The group lost a rank and killed the others: start new generations, `FIRST_RETRY_S` apart doubling to
        `LAST_RETRY_S`, until one runs (`Ready`) or the engine closes. Every failure that causes a restart is
        counted by its label."""
        failure = self.group.failure or Failed(FailureReason.STEP_FAILED, 0, "unknown")
        self._count(failure)
        self._on_event(Restarting(failure))
        backoff = Backoff(FIRST_RETRY_S, LAST_RETRY_S)
        while True:
            try:
                self._restart()
            except ExecutorFailure as again:
                if self.group.closing:
                    return
                self._count(again.failure)
                self._on_event(RestartFailed(again.failure, backoff.delay))
                if self.group.wait_closing(backoff.delay):
                    return
                backoff.grow()
            else:
                self._on_event(Ready())
                return

    def _restart(self) -> None:
        """A new generation of ranks: spawn, load, join. The driver's pool is zeroed (what it held is unusable
        without the other parts). ExecutorFailure if this generation fails too."""
        self.stage = None
        self.group.spawn()
        self.runner.kv_cache.zero_()
        self.start()

    def _count(self, failure: Failed) -> None:
        self._restarts[failure.label] = self._restarts.get(failure.label, 0) + 1

    def restarts(self) -> dict[str, int]:
        return dict(self._restarts)

    def begin_close(self) -> None:
        self.group.begin_close()

    def close(self) -> None:
        self.group.stop()  # each rank closes its tiers

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        if self.stage is None:
            stopped = Failed(FailureReason.STEP_FAILED, 0, "the group is not running")
            raise ExecutorFailure(self.group.failure or stopped)
        groups = _micro_batches(chunks, self.plan.pp_size)
        batches = [self.runner.prepare(group) for group in groups]
        self.group.send(wire.Step([wire.encode_batch(batch) for batch in batches], _traced_prefills(chunks)))
        try:  # from here on every rank is in the step: any failure leaves the group out of step
            own = self.stage.run(batches)
            logits = self.stage.gather_logits(batches, own)
        except Exception as err:
            raise self.group.step_failed(err) from err
        return _join(groups, logits)

    def ranks(self) -> list[RankStats]:
        busy = self.stage.busy_s if self.stage is not None else 0.0
        own = RankStats(self._worker_id, 0, os.getpid(), self.stage is not None, resident_bytes(), busy)
        return [own, *self.group.statuses(self._worker_id)]


def _micro_batches(chunks: list[ScheduledChunk], count: int) -> list[list[ScheduledChunk]]:
    """Contiguous groups of chunks with about equal tokens, at most `count` (one per pipeline stage, so that
    every stage has work while the next computes the group before)."""
    if count <= 1 or len(chunks) <= 1:
        return [chunks]
    total = sum(c.num_tokens for c in chunks)
    groups: list[list[ScheduledChunk]] = [[]]
    done = 0
    for chunk in chunks:
        if groups[-1] and len(groups) < count and done >= total * len(groups) / count:
            groups.append([])
        groups[-1].append(chunk)
        done += chunk.num_tokens
    return groups


def _join(groups: list[list[ScheduledChunk]], logits: list[torch.Tensor]) -> torch.Tensor:
    """One logits tensor in the order the core reads (sampling rows of every chunk in order, then the prompt
    logprob rows in order) from the micro-batches' logits (each: its sampling rows, then its prompt rows)."""
    if len(logits) == 1:
        return logits[0]
    sampling = [sum(c.seq.num_computed_tokens + c.num_tokens == c.seq.num_tokens for c in g) for g in groups]
    return torch.cat([part[:n] for part, n in zip(logits, sampling, strict=True)]
                     + [part[n:] for part, n in zip(logits, sampling, strict=True)])  # fmt: skip


def _traced_prefills(chunks: list[ScheduledChunk]) -> list[tuple[str, int]]:
    """(traceparent of the request's engine span, tokens) of each prompt chunk of a traced request."""
    if not tracing.enabled():
        return []
    return [
        (tracing.traceparent_of(c.seq.trace.span) or "", c.num_tokens)
        for c in chunks
        if c.seq.trace is not None and c.seq.num_computed_tokens < c.seq.num_prompt_tokens
    ]


class ShardedConnector:
    """Implements `kvbm.api.KVConnector` for a group: the driver's tiers (`local`, which also publishes the
    index's events) and every other rank's, asked in the same order."""

    def __init__(self, local: KVConnector, group: RankGroup) -> None:
        self.local = local
        self.group = group

    def bind(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        self.local.bind(kv_cache, layout)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        found = self.local.lookup(block_hashes)
        if found == 0:
            return 0
        _, answers = self.group.ask(wire.Lookup(0, [int(h) for h in block_hashes[:found]]), lambda: None)
        return min(found, *answers)

    def onboard(
        self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], reads: list[TierRead] | None = None
    ) -> int:
        """Every rank's tiers read; `reads` are the driver's (its rank's share of each block)."""
        question = wire.Onboard(0, [int(h) for h in block_hashes], list(block_ids))
        own, answers = self.group.ask(question, lambda: self.local.onboard(block_hashes, block_ids, reads))
        return min(own, *answers)

    def offload(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        question = wire.Offload(0, [int(h) for h in block_hashes], list(block_ids))
        self.group.ask(question, lambda: self.local.offload(block_hashes, block_ids))

    def on_event(self, event: BlockEvent) -> None:
        self.local.on_event(event)

    def close(self) -> None:
        self.local.close()
