"""The request state machine (server/router/state.py, `Flight.move`): every allowed move is taken, every other
one is refused as a bug."""

from __future__ import annotations

import itertools
import logging

import pytest

from server.engine.api import GenerationRequest, RequestId, SamplingParams
from server.router.flight import Flight
from server.router.state import TRANSITIONS, IllegalTransition, RequestState

# in a fixed order: sets of enum members iterate in hash order, which differs between processes (pytest-xdist's
# workers must collect the same list)
ALLOWED = [
    (current, target)
    for current, targets in TRANSITIONS.items()
    for target in sorted(targets, key=lambda state: state.name)
]
REFUSED = [
    (current, target)
    for current, target in itertools.product(RequestState, RequestState)
    if target not in TRANSITIONS[current]
]


def _flight(state: RequestState) -> Flight:
    return Flight(GenerationRequest(RequestId("r"), [1, 2, 3], SamplingParams()), state=state)


def test_the_table_covers_every_state_and_every_state_is_reachable_and_can_end() -> None:
    assert set(TRANSITIONS) == set(RequestState)
    reachable, frontier = {RequestState.QUEUED}, [RequestState.QUEUED]
    while frontier:
        for target in TRANSITIONS[frontier.pop()] - reachable:
            reachable.add(target)
            frontier.append(target)
    assert reachable == set(RequestState)
    assert all(
        RequestState.FINISHED in TRANSITIONS[s] for s in RequestState if s is not RequestState.FINISHED
    )


@pytest.mark.parametrize(("current", "target"), ALLOWED, ids=lambda s: s.name)
def test_an_allowed_move_is_taken(current: RequestState, target: RequestState) -> None:
    flight = _flight(current)
    flight.move(target)
    assert flight.state is target


@pytest.mark.parametrize(("current", "target"), REFUSED, ids=lambda s: s.name)
def test_a_move_the_table_does_not_allow_is_logged_and_refused(
    current: RequestState, target: RequestState, caplog: pytest.LogCaptureFixture
) -> None:
    flight = _flight(current)
    with caplog.at_level(logging.ERROR, logger="server.router.state"), pytest.raises(IllegalTransition):
        flight.move(target)
    assert flight.state is current
    assert f"{current} -> {target}" in caplog.text


def test_an_aborted_request_is_not_placed_again_and_only_finishes() -> None:
    for state in set(RequestState) - {RequestState.ABORTED, RequestState.FINISHED}:
        flight = _flight(state)
        flight.abort()
        assert flight.state is RequestState.ABORTED
        assert not flight.advance(RequestState.DECODING) and flight.state is RequestState.ABORTED
    finished = _flight(RequestState.FINISHED)
    finished.abort()
    assert finished.state is RequestState.FINISHED
    aborted = _flight(RequestState.ABORTED)
    aborted.move(RequestState.FINISHED)
    assert aborted.state is RequestState.FINISHED


def test_advance_is_a_checked_move_when_not_aborted() -> None:
    flight = _flight(RequestState.QUEUED)
    assert flight.advance(RequestState.ROUTED) and flight.state is RequestState.ROUTED
    with pytest.raises(IllegalTransition):
        flight.advance(RequestState.HANDOFF)
