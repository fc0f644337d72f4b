"""The executor: what computes the engine's steps, as the engine core and `LLMEngine` see it. The in-process
`ModelRunner` (server/engine/model_runner.py) and a sharded worker's `ShardedExecutor` over its group of rank
processes (server/engine/parallel/executor.py) both implement `ModelExecutor`; nothing above them asks which.

An executor that can lose a part of itself reports its life as typed events (`ExecutorEvent`) to the callback
it was built with:

    running --Failed (any thread)--> the engine sees it, or a step raises ExecutorFailure
            --recover() (engine thread)--> Restarting --> [RestartFailed, a backoff wait]... --> Ready --> running
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from server.engine.api import RankStats
from server.engine.scheduler import ScheduledChunk


class FailureReason(enum.Enum):
    """Why an executor lost a part of itself. The value is the `reason` label of strata_worker_restarts_total,
    except for a rank that exited: its signal's name (SIGKILL) or exit_code_<code> (`Failed.label`)."""

    SIGNAL = "signal"  # a rank exited on a signal
    EXIT_CODE = "exit_code"  # a rank exited with a code
    HEARTBEAT = "heartbeat"  # a ready rank stopped beating
    START_FAILED = "start_failed"  # a rank failed to load, was not ready in time, or the group did not form
    STEP_FAILED = "step_failed"  # a step, a message to the ranks or a KV question to them failed


@dataclass(frozen=True, slots=True)
class Failed:
    """Event (from whichever thread saw it first, once per failed generation): a part of the executor is gone or
    stuck, every rank was killed, and nothing in the KV pool can be trusted."""

    reason: FailureReason
    rank: int
    detail: str  # what happened, in words: "exited on SIGKILL", "no heartbeat for 4.1 s (stuck or stopped)"
    signal: str | None = None  # reason SIGNAL: the signal's name ("SIGKILL"; "signal 99" for an unnamed one)
    exit_code: int | None = None  # reason EXIT_CODE
    at: float = field(default_factory=time.monotonic)  # when it was seen (time.monotonic)

    @property
    def label(self) -> str:
        """The `reason` label of strata_worker_restarts_total."""
        if self.reason is FailureReason.SIGNAL:
            return self.signal or self.reason.value
        if self.reason is FailureReason.EXIT_CODE:
            return f"exit_code_{self.exit_code}"
        return self.reason.value

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Restarting:
    """Event (engine thread, first in `recover`): a new generation starts after `failure`; nothing the old one
    computed survives."""

    failure: Failed


@dataclass(frozen=True, slots=True)
class RestartFailed:
    """Event (engine thread, in `recover`): the new generation failed too; the next starts in `retry_in_s`
    seconds (1 s, doubling to 30 s) unless the engine closes meanwhile."""

    failure: Failed
    retry_in_s: float


@dataclass(frozen=True, slots=True)
class Ready:
    """Event (engine thread, last in `recover`): the executor runs steps again."""


ExecutorEvent = Failed | Restarting | RestartFailed | Ready


class ExecutorFailure(RuntimeError):
    """The executor lost a part of itself (`failure`): the step did not happen and it runs nothing until it has
    recovered. Not a request's fault: the core lets it through to the engine, which calls `recover`."""

    def __init__(self, failure: Failed) -> None:
        super().__init__(str(failure))
        self.failure = failure


class ModelExecutor(Protocol):
    """Computes the engine's steps on the engine thread."""

    @property
    def shard_layout(self) -> str:
        """ "tp<T>pp<P>" when the model is split over ranks (each rank's tiers hold its part of a block), "" when
        one process holds all of it."""
        ...

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits [sampling chunks, vocab] fp32, one row per chunk that ends at its sequence's last token, in the
        order of `chunks`, then the rows of owed prompt logprobs; KV for every scheduled token is written into the
        pool. Raises ExecutorFailure when it cannot compute any step; any other exception is the step's own."""
        ...

    def recover(self) -> None:
        """After a failure: restart until it runs again (`Ready`) or the engine closes, reporting each event."""
        ...

    def ranks(self) -> list[RankStats]:
        """Each rank's process, the driver first; [] for an executor of one process."""
        ...

    def restarts(self) -> dict[str, int]:
        """How many times it restarted, by `Failed.label`."""
        ...

    def begin_close(self) -> None:
        """From any thread: a `recover` in progress gives up (the engine is closing)."""
        ...

    def close(self) -> None:
        """After the engine thread has ended: stop every other process."""
        ...
