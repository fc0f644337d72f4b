"""How an engine's requests live through its executor's failures: the engine's side of the executor's events
(server/engine/executor.py). An executor of one process reports none, and its engine stays UP.

    UP --Failed (seen between steps)--> FAILED --Restarting--> RESTARTING --Ready--> UP
    UP --Restarting (a step raised ExecutorFailure)--> RESTARTING
    RESTARTING or DOWN --RestartFailed--> DOWN --Ready--> UP

On a failure the pool's contents are gone: the engine ends its requests as retryable errors for its router to resume
elsewhere (`RankFailurePolicy` "migrate": a worker process among others), or requeues them for the restarted
executor ("resume": the only engine of a model, each request at most `resume_limit` times). While it restarts, a
migrating worker refuses new requests (its router tries another); while a restart keeps failing (DOWN), every
engine refuses them and ends those it holds.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Literal

from server.engine.api import EngineOverloaded, EngineUnavailable, RequestId
from server.engine.executor import ExecutorEvent, Failed, Ready, RestartFailed, Restarting
from server.engine.inbox import Inbox

if TYPE_CHECKING:
    from server.engine.core import EngineCore

log = logging.getLogger(__name__)

RankFailurePolicy = Literal["resume", "migrate"]


class ExecutorState(enum.Enum):
    UP = "up"
    FAILED = "failed"  # seen failing between steps: the engine thread is to call `recover`
    RESTARTING = "restarting"
    DOWN = "down"  # its last restart failed; the next is after a backoff


_MOVES = {
    ExecutorState.UP: {ExecutorState.FAILED, ExecutorState.RESTARTING},
    ExecutorState.FAILED: {ExecutorState.RESTARTING},
    ExecutorState.RESTARTING: {ExecutorState.DOWN, ExecutorState.UP},
    ExecutorState.DOWN: {ExecutorState.DOWN, ExecutorState.UP},
}


class Recovery:
    """`on_event` is the executor's event callback; the state is guarded by the inbox's lock, so that a submit
    sees it and the unfinished requests together. `bind` the built core before the first event on the engine
    thread."""

    def __init__(self, inbox: Inbox, policy: RankFailurePolicy, resume_limit: int, worker_id: str) -> None:
        self._inbox = inbox
        self._policy = policy
        self._resume_limit = resume_limit
        self._worker_id = worker_id
        self._resumes: dict[RequestId, int] = {}  # requests requeued after a failure -> how many times
        self.state = ExecutorState.UP
        self._core: EngineCore | None = None
        self._model_name = ""

    def bind(self, core: EngineCore, model_name: str) -> None:
        self._core, self._model_name = core, model_name

    @property
    def failed(self) -> bool:
        """The executor failed between steps and the engine thread has not begun its recovery."""
        return self.state is ExecutorState.FAILED

    def check_admission(self) -> None:
        """Under the inbox's lock: refuse a request the executor cannot take now (DOWN: unavailable; restarting
        in a migrating worker: overloaded, so its router tries another). A resuming engine queues it."""
        if self.state is ExecutorState.DOWN:
            raise EngineUnavailable(f"{self._model_name}: its ranks failed and are restarting; retry later")
        if self.state is ExecutorState.RESTARTING and self._policy == "migrate":
            raise EngineOverloaded(
                f"{self._model_name}: this worker is restarting its ranks", retry_after_s=1.0
            )

    def forget(self, request_id: RequestId) -> None:
        """The core finished `request_id` (engine thread)."""
        self._resumes.pop(request_id, None)

    def on_event(self, event: ExecutorEvent) -> None:
        match event:
            case Failed():
                with self._inbox.lock:
                    if self.state is ExecutorState.UP:
                        self._move(ExecutorState.FAILED)
                    self._inbox.wake()
            case Restarting(failure=failure):
                self._restarting(failure)
            case RestartFailed(failure=failure, retry_in_s=delay):
                self._down(failure, delay)
            case Ready():
                with self._inbox.lock:
                    self._move(ExecutorState.UP)
                log.info("%s worker %s: rank group running again", self._model_name, self._worker_id)

    def _move(self, state: ExecutorState) -> None:
        if state not in _MOVES[self.state]:
            raise RuntimeError(f"executor state {self.state.value} cannot become {state.value}")
        self.state = state

    def _restarting(self, failure: Failed) -> None:
        """End or requeue every request (see the module), and forget the prefix cache."""
        core = self._core
        assert core is not None, "bind the core first"
        migrate = self._policy == "migrate"
        with self._inbox.lock:
            self._move(ExecutorState.RESTARTING)
            unfinished = self._inbox.unfinished(drop_queued=migrate)
        if migrate:
            for seq in unfinished:
                core.hand_back(seq, f"the worker's rank group failed ({failure})")
        else:
            self._requeue(core, failure)
        forgotten = core.scheduler.block_manager.forget_cached()
        log.error(
            "%s worker %s: %s; %d requests %s, %d cached blocks dropped; restarting the group",
            self._model_name, self._worker_id, failure, len(unfinished),
            "handed back for migration" if migrate else "requeued", forgotten,
        )  # fmt: skip

    def _requeue(self, core: EngineCore, failure: Failed) -> None:
        """Running requests wait for the restarted executor, each at most `resume_limit` times; past that one ends
        with a retryable error (503 at the frontend)."""
        for seq in core.requeue_all():
            resumes = self._resumes.get(seq.request_id, 0) + 1
            self._resumes[seq.request_id] = resumes
            if resumes > self._resume_limit:
                core.hand_back(
                    seq,
                    f"{self._model_name}: its rank group failed {resumes} times during this request ({failure})",
                )

    def _down(self, failure: Failed, retry_in_s: float) -> None:
        """A restart failed: nothing runs until one succeeds, so no request waits for it."""
        core = self._core
        assert core is not None, "bind the core first"
        log.error("%s: restarting the rank group failed (%s); next try in %.0f s", self._model_name,
                  failure, retry_in_s)  # fmt: skip
        with self._inbox.lock:
            self._move(ExecutorState.DOWN)
            waiting = self._inbox.unfinished(drop_queued=True)
        for seq in waiting:
            core.hand_back(seq, f"{self._model_name}: its rank group is down ({failure})")
