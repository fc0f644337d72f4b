"""An executor's failures as the engine sees them, without rank processes: the metric label of each failure, the
sharded executor's restart loop (counts, events, backoff), and the engine's state machine over those events
(server/engine/recovery.py). The real group's kill-and-restart runs in test_sharding.py and
tests/server/test_sharded_workers.py; the failing-restart path is only reachable here."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from server.engine.api import EngineOverloaded, EngineUnavailable, RequestId
from server.engine.executor import (
    ExecutorFailure,
    Failed,
    FailureReason,
    Ready,
    RestartFailed,
    Restarting,
)
from server.engine.inbox import Inbox
from server.engine.parallel.executor import FIRST_RETRY_S, ShardedExecutor
from server.engine.recovery import ExecutorState, Recovery

KILLED = Failed(FailureReason.SIGNAL, 1, "exited on SIGKILL", signal="SIGKILL")


def test_each_failure_has_the_restart_metrics_label() -> None:
    assert KILLED.label == "SIGKILL"
    assert Failed(FailureReason.EXIT_CODE, 2, "exited with 3", exit_code=3).label == "exit_code_3"
    assert Failed(FailureReason.HEARTBEAT, 1, "no heartbeat").label == "heartbeat"
    assert Failed(FailureReason.START_FAILED, 0, "joining failed").label == "start_failed"
    assert Failed(FailureReason.STEP_FAILED, 0, "a send failed").label == "step_failed"
    assert str(KILLED) == "rank 1: exited on SIGKILL"


@dataclass
class FakeGroup:
    """What ShardedExecutor.recover reads of its RankGroup; waits are recorded, never slept."""

    failure: Failed | None = KILLED
    closing: bool = False
    waits: list[float] = field(default_factory=list)
    close_on_wait: int | None = None  # the engine closes during this wait (1-based)

    def wait_closing(self, timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        self.closing = len(self.waits) == self.close_on_wait
        return self.closing


def sharded(group: FakeGroup, restarts_failing: int) -> tuple[ShardedExecutor, list]:
    events: list = []
    executor = ShardedExecutor(None, group, None, 1.0, "w0", events.append)  # type: ignore[arg-type]
    tries = iter(range(restarts_failing + 1))

    def restart() -> None:
        if next(tries) < restarts_failing:
            raise ExecutorFailure(Failed(FailureReason.START_FAILED, 2, "rank 2 not ready in time"))

    executor._restart = restart  # type: ignore[method-assign]  # no rank processes here
    return executor, events


def test_a_restart_that_keeps_failing_backs_off_counts_each_cause_then_runs() -> None:
    group = FakeGroup()
    executor, events = sharded(group, restarts_failing=2)
    executor.recover()
    assert [type(e) for e in events] == [Restarting, RestartFailed, RestartFailed, Ready]
    assert events[0].failure is KILLED
    assert [e.retry_in_s for e in events[1:3]] == [FIRST_RETRY_S, 2 * FIRST_RETRY_S] == group.waits
    assert executor.restarts() == {"SIGKILL": 1, "start_failed": 2}


def test_a_closing_engine_ends_the_restart_loop() -> None:
    group = FakeGroup(close_on_wait=1)
    executor, events = sharded(group, restarts_failing=5)
    executor.recover()
    assert [type(e) for e in events] == [Restarting, RestartFailed]  # no Ready, no second try


@dataclass
class FakeSeq:
    request_id: RequestId


class FakeCore:
    """What Recovery calls on the engine core."""

    def __init__(self, running: list[FakeSeq]) -> None:
        self.running = running
        self.handed_back: list[tuple[RequestId, str]] = []
        self.scheduler = self
        self.block_manager = self

    def hand_back(self, seq: FakeSeq, reason: str) -> None:
        self.handed_back.append((seq.request_id, reason))

    def requeue_all(self) -> list[FakeSeq]:
        return list(self.running)

    def forget_cached(self) -> int:
        return 0


def recovery(policy: str, core: FakeCore, resume_limit: int = 2) -> Recovery:
    state = Recovery(Inbox(), policy, resume_limit, "w0")  # type: ignore[arg-type]
    state.bind(core, "m")  # type: ignore[arg-type]
    return state


def test_a_migrating_worker_refuses_while_it_restarts_and_is_unavailable_while_down() -> None:
    state = recovery("migrate", FakeCore([]))
    state.on_event(KILLED)
    assert state.state is ExecutorState.FAILED and state.failed
    state.on_event(Restarting(KILLED))
    with pytest.raises(EngineOverloaded):  # its router tries another worker
        state.check_admission()
    state.on_event(RestartFailed(KILLED, 1.0))
    assert state.state is ExecutorState.DOWN
    with pytest.raises(EngineUnavailable):
        state.check_admission()
    state.on_event(Ready())
    assert state.state is ExecutorState.UP
    state.check_admission()


def test_a_resuming_engine_requeues_each_request_at_most_resume_limit_times() -> None:
    core = FakeCore([FakeSeq(RequestId("a"))])
    state = recovery("resume", core, resume_limit=2)
    for _ in range(3):
        state.on_event(Restarting(KILLED))
        state.check_admission()  # the only engine of its model queues new requests meanwhile
        state.on_event(Ready())
    assert len(core.handed_back) == 1 and core.handed_back[0][0] == "a"  # the third failure ends it
    assert "failed 3 times" in core.handed_back[0][1]


def test_an_event_out_of_order_is_refused() -> None:
    state = recovery("resume", FakeCore([]))
    with pytest.raises(RuntimeError, match="up cannot become down"):
        state.on_event(RestartFailed(KILLED, 1.0))
