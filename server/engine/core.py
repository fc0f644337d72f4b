"""The engine core: one step is `scheduler.schedule()` -> `runner.run()` -> `update_from_output()`.

Single-threaded: only the engine thread calls it. A fault is contained to the requests it belongs to:
- a sequence whose scheduling raises (its admission, a read of its handoff, a lower tier) fails alone;
- a batched forward or sampler that raises is retried one sequence at a time (rewriting a KV slot with the same
  values is harmless);
- per-sequence work after the forward (block registration, stop checks, detokenizing, the sink) fails only its
  own request.

The runner is a `ModelExecutor` (server/engine/executor.py): `run(chunks) -> logits` over the scheduler's chunks,
whether one process computes them or a group of ranks; the core never asks which. Logits processors (penalties,
min_tokens, grammar bitmasks) are stages of the sampler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from server import tracing
from server.engine.api import FinishReason, RequestId, TokenLogprobs
from server.engine.executor import ExecutorFailure, ModelExecutor
from server.engine.kv_transfer import KVTransferConnector
from server.engine.output_processor import OutputProcessor
from server.engine.sampler import Sampler, top_logprobs
from server.engine.scheduler import ScheduledChunk, Scheduler
from server.engine.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelExecutor,
        sampler: Sampler,
        outputs: OutputProcessor,
        kv_transfer: KVTransferConnector,
        on_finished: Callable[[RequestId], None],
    ) -> None:
        """`on_finished(request_id)` is called once per request, before its final output is emitted."""
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.outputs = outputs
        self.kv_transfer = kv_transfer
        self._on_finished = on_finished

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def add(self, seq: Sequence) -> None:
        try:
            self.scheduler.add(seq)
        except Exception as err:
            log.exception("queueing request %s failed", seq.request_id)
            self.fail([seq], err)

    @torch.inference_mode()
    def step(self) -> None:
        """Schedule, forward and sample once; emit what the step produced."""
        scheduled = self.scheduler.schedule()
        for seq, err in scheduled.failed:
            log.error("scheduling request %s failed: %r", seq.request_id, err)
            self.fail([seq], err)
        chunks = scheduled.chunks
        if not chunks:
            return
        started_ns = time.time_ns()  # a traced prompt chunk's span starts here
        try:
            logits = self.runner.run(chunks)
        except ExecutorFailure:
            raise
        except Exception as err:
            if len(chunks) == 1:
                log.exception("engine step failed for request %s", chunks[0].seq.request_id)
                self.fail([chunks[0].seq], err)
                return
            log.warning(
                "batched step of %d sequences failed (%r); retrying them one by one", len(chunks), err
            )
            for chunk in chunks:
                self._step_alone(chunk)
            return
        if tracing.enabled():
            self._trace_prefills(chunks, started_ns)
        self.update_from_output(chunks, logits)

    @staticmethod
    def _trace_prefills(chunks: list[ScheduledChunk], started_ns: int) -> None:
        """A prefill span for each traced chunk of a prompt (before update_from_output advances it)."""
        now = 0
        for chunk in chunks:
            seq = chunk.seq
            if seq.trace is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                now = now or time.time_ns()
                seq.trace.prefilled(started_ns, now, seq.num_computed_tokens, chunk.num_tokens)

    def _step_alone(self, chunk: ScheduledChunk) -> None:
        if chunk.seq.status is SequenceStatus.FINISHED:  # failed in an earlier retry of this step
            return
        try:
            logits = self.runner.run([chunk])
        except ExecutorFailure:
            raise
        except Exception as err:
            log.exception("engine step failed for request %s", chunk.seq.request_id)
            self.fail([chunk.seq], err)
            return
        self.update_from_output([chunk], logits)

    def update_from_output(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> None:
        """Advance each chunk's sequence, register its full blocks, sample the sequences whose prompt is done,
        and emit."""
        sampling, rows, row = [], [], 0  # each sampling sequence's row of `logits`
        owed: list[tuple[Sequence, range]] = []  # prompt positions whose logits follow the sampling rows
        for chunk in chunks:
            seq = chunk.seq
            start = seq.num_computed_tokens
            ends = start + chunk.num_tokens == seq.num_tokens
            positions = seq.prompt_logprob_positions(start, start + chunk.num_tokens)
            if positions:
                owed.append((seq, positions))
            try:
                seq.num_computed_tokens += chunk.num_tokens
                self.scheduler.block_manager.register_full_blocks(seq)
            except Exception as err:
                log.exception("registering the blocks of request %s failed", seq.request_id)
                self.fail([seq], err)
            else:
                if ends:
                    sampling.append(seq)
                    rows.append(row)
            row += ends
        if owed:
            self._prompt_logprobs(logits[row:], owed)
            alive = [i for i, seq in enumerate(sampling) if seq.status is not SequenceStatus.FINISHED]
            sampling, rows = [sampling[i] for i in alive], [rows[i] for i in alive]
        if not sampling:
            return
        if len(rows) < logits.shape[0]:
            logits = logits[rows]
        for seq, drawn in zip(sampling, self._sample(logits, sampling), strict=True):
            if drawn is not None:
                self._advance(seq, *drawn)

    def _prompt_logprobs(self, logits: torch.Tensor, owed: list[tuple[Sequence, range]]) -> None:
        """Each position's logits give the next prompt token's logprob and the top alternatives (raw logits, fp32):
        one log-softmax and one topk for the step's rows."""
        try:
            logprobs = logits.log_softmax(dim=-1)
            targets = [seq.token_ids[p + 1] for seq, positions in owed for p in positions]
            counts = [seq.sampling.prompt_logprobs for seq, positions in owed for _ in positions]
            entries = top_logprobs(logprobs, torch.tensor(targets, device=logits.device), counts)
        except Exception as err:
            log.exception("prompt logprobs failed")
            self.fail([seq for seq, _ in owed], err)
            return
        done = 0
        for seq, positions in owed:
            seq.prompt_logprobs.extend(entries[done : done + len(positions)])
            done += len(positions)

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> list[tuple[int, TokenLogprobs | None] | None]:
        """(token, its logprobs) per sequence; None for a sequence whose sampling failed (it is failed)."""
        try:
            out = self.sampler(logits, seqs)
            return list(zip(out.token_ids, out.logprobs, strict=True))
        except Exception as err:
            if len(seqs) == 1:
                log.exception("sampling failed for request %s", seqs[0].request_id)
                self.fail(seqs, err)
                return [None]
            log.warning(
                "batched sampling of %d sequences failed (%r); sampling them one by one", len(seqs), err
            )
            return [self._sample_alone(seq, logits[i : i + 1]) for i, seq in enumerate(seqs)]

    def _sample_alone(self, seq: Sequence, logits: torch.Tensor) -> tuple[int, TokenLogprobs | None] | None:
        try:
            out = self.sampler(logits, [seq])
            return out.token_ids[0], out.logprobs[0]
        except Exception as err:
            log.exception("sampling failed for request %s", seq.request_id)
            self.fail([seq], err)
            return None

    def _advance(self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None) -> None:
        """Append a sampled token, then finish, hand off or emit."""
        try:
            seq.append_token(token_id)
            if seq.trace is not None and seq.num_output_tokens == 1:
                seq.trace.first_token()
            if logprobs is not None:
                seq.logprobs.append(logprobs)
            reason = self.outputs.check_stop(seq, token_id)
            if reason:
                self.finish(seq, reason)
            elif self.kv_transfer.wants_hand_off(seq):
                self._hand_off(seq)
            elif not self.outputs.emit(seq, finished=False):
                self.finish(seq, "abort")
        except Exception as err:
            log.exception("finishing the step of request %s failed", seq.request_id)
            self.fail([seq], err)

    def _hand_off(self, seq: Sequence) -> None:
        """A prefill-only request has its first token: hand its KV off and finish it here with the handoff."""
        params = self.kv_transfer.hand_off(seq)
        self.scheduler.remove(seq)
        self._on_finished(seq.request_id)
        _end_trace(seq, "handed_off")
        self.outputs.emit(seq, finished=True, kv_transfer_params=params)

    def fail(self, seqs: list[Sequence], err: Exception) -> None:
        """Finish `seqs` with finish_reason "error". The exception is logged with each request's id; a client sees
        only that id (the exception's text may hold internals: paths, shapes, another request's data)."""
        for seq in seqs:
            log.error("request %s failed: %s: %s", seq.request_id, type(err).__name__, err)
            error = f"internal engine error (request {seq.request_id}); see the server log"
            self.finish(seq, "error", error=error)

    def requeue_all(self) -> list[Sequence]:
        """After an executor failure: every running sequence back to the head of the wait queue, its blocks freed
        (recomputed, as after a preemption), oldest first. Returns the requeued sequences."""
        requeued, self.scheduler.running = self.scheduler.running, []
        for seq in reversed(requeued):
            self.scheduler.preempt(seq)
        return requeued

    def hand_back(self, seq: Sequence, error: str) -> None:
        """End `seq` here without failing it: its final output is a retryable error, so that a router resumes it
        on another worker from the tokens its client has (server/router/migration.py)."""
        if seq.status is SequenceStatus.FINISHED:
            return
        self.scheduler.remove(seq)
        self._on_finished(seq.request_id)
        _end_trace(seq, "handed_back", error)
        self.outputs.emit_retryable(seq, error)

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """End `seq` (free its blocks) and send its final output. Idempotent."""
        if seq.status is SequenceStatus.FINISHED:
            return
        self.scheduler.remove(seq)
        self._on_finished(seq.request_id)
        _end_trace(seq, reason, error)
        self.outputs.emit(seq, finished=True, reason=reason, error=error)


def _end_trace(seq: Sequence, reason: str, error: str | None = None) -> None:
    if seq.trace is not None:
        trace, seq.trace = seq.trace, None
        trace.end(reason, seq.num_output_tokens, error)
