"""One rank's part of a step: its pipeline stage's layers over each micro-batch of the step.

    stage 0  ─ mb0 ─ mb1 ─┐            (each arrow a point-to-point send of the residual stream [T, hidden])
    stage 1       ─ mb0 ─ mb1 ─┐       the last stage's ranks send their vocabulary slices of the logits of
    ...                        ▼       each micro-batch to the driver, which joins them
    driver: logits [rows, vocab] per micro-batch

With more than one micro-batch in flight the stages overlap: stage 0 computes micro-batch 1 while stage 1
computes micro-batch 0. Sends are started and waited on at the end of the step, so a stage never waits for its
successor to take a tensor before starting its next micro-batch.
"""

from __future__ import annotations

import time

import torch

from server.engine.model import LlamaModel, StepBatch
from server.engine.parallel.comm import HIDDEN_TAG, LOGITS_TAG, GroupComm
from server.engine.parallel.plan import ShardPlan, vocab_slice


class StageRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, comm: GroupComm, plan: ShardPlan) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.comm = comm
        self.plan = plan
        self.busy_s = 0.0  # seconds computing (not waiting on a peer), cumulative

    def run(self, batches: list[StepBatch]) -> list[torch.Tensor]:
        """Compute this rank's layers for every micro-batch. Returns this rank's logits slices [rows, vocab rows
        here] per micro-batch when it is the driver on the last stage; else [] (they went to the driver)."""
        plan, model = self.plan, self.model
        pending: list[tuple[object, torch.Tensor]] = []  # (work, the tensor it sends): alive until waited on
        kept: list[torch.Tensor] = []
        for index, batch in enumerate(batches):
            hidden = None
            if not plan.first_stage:
                rows = batch.token_ids.shape[0]
                hidden = torch.empty(rows, model.shape.hidden_size, dtype=model.dtype, device=model.device)
                self.comm.recv(hidden, plan.peer(plan.stage - 1), HIDDEN_TAG + index)
            started = time.perf_counter()
            out = model.forward(batch, self.kv_cache, hidden)
            self.busy_s += time.perf_counter() - started
            if not plan.last_stage:
                pending.append((self.comm.send(out, plan.peer(plan.stage + 1), HIDDEN_TAG + index), out))
            elif plan.rank == 0:
                kept.append(out)
            elif out.shape[
                0
            ]:  # no logits rows (a prompt chunk that does not end its prompt): nothing to send
                pending.append((self.comm.send(out, 0, LOGITS_TAG + index), out))
        for work, _ in pending:
            work.wait()
        return kept

    def gather_logits(self, batches: list[StepBatch], own: list[torch.Tensor]) -> list[torch.Tensor]:
        """The driver: each micro-batch's logits [rows, vocab], its last stage's slices joined in vocabulary
        order (`own`: the driver's slices when it is on the last stage)."""
        plan, vocab = self.plan, self.model.shape.vocab_size
        last = plan.stage_ranks(plan.pp_size - 1)
        joined = []
        for index, batch in enumerate(batches):
            rows = batch.logits_rows.shape[0]
            parts = []
            for tp_rank, rank in enumerate(last):
                if rank == 0:
                    parts.append(own[index])
                    continue
                width = len(vocab_slice(vocab, plan.tp_size, tp_rank))
                part = torch.empty(rows, width, dtype=torch.float32, device=self.model.device)
                if rows:
                    self.comm.recv(part, rank, LOGITS_TAG + index)
                parts.append(part)
            joined.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
        return joined
