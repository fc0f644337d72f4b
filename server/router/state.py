"""Where a request is in the router: one state, and the moves allowed between states (`TRANSITIONS`).

    aggregated       QUEUED ──► ROUTED ──► DECODING ──► FINISHED
    disaggregated    QUEUED ──► PREFILLING_REMOTE ──► HANDOFF ──► DECODING ──► FINISHED
    prefill died     PREFILLING_REMOTE ──► QUEUED ──► PREFILLING_REMOTE (another) or ROUTED (the decode worker)
    worker died      ROUTED or DECODING ──► MIGRATING ──► ROUTED or DECODING (on another worker)
    offer refused    back where it was placed from: ROUTED ──► QUEUED or MIGRATING, PREFILLING_REMOTE ──► QUEUED,
                     DECODING ──► HANDOFF or MIGRATING

Every state but FINISHED may go to ABORTED (the client left) and to FINISHED (the client has its last output);
ABORTED goes only to FINISHED: an aborted request waits for its worker's last output and is never placed again.
A move the table does not allow is a bug in the router: it is logged and raised (`IllegalTransition`).
"""

from __future__ import annotations

import enum
import logging

logger = logging.getLogger(__name__)


class RequestState(enum.Enum):
    QUEUED = "queued"  # on no worker and no token out: being placed (or placed again after a prefill worker)
    ROUTED = "routed"  # offered to or running on a worker that prefills it itself; no token out yet
    PREFILLING_REMOTE = "prefilling_remote"  # on a prefill worker; its decode worker is chosen
    HANDOFF = "handoff"  # the prefill worker handed off its KV and first token: placing it on a decode worker
    DECODING = "decoding"  # its first token is out; offered to or running on the worker that decodes it
    MIGRATING = "migrating"  # its worker died: being resumed on another from the tokens so far
    ABORTED = "aborted"  # the client left: waiting for its worker's last output
    FINISHED = "finished"  # the client has its last output; out of the router's table


_S = RequestState
_ENDS = {_S.ABORTED, _S.FINISHED}
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _S.QUEUED: frozenset({_S.ROUTED, _S.PREFILLING_REMOTE, *_ENDS}),
    _S.ROUTED: frozenset({_S.QUEUED, _S.DECODING, _S.MIGRATING, *_ENDS}),  # QUEUED: refused
    _S.PREFILLING_REMOTE: frozenset({_S.QUEUED, _S.HANDOFF, *_ENDS}),  # QUEUED: refused or died
    _S.HANDOFF: frozenset({_S.DECODING, *_ENDS}),
    _S.DECODING: frozenset({_S.HANDOFF, _S.MIGRATING, *_ENDS}),  # HANDOFF: the decode worker refused it
    _S.MIGRATING: frozenset({_S.ROUTED, _S.DECODING, *_ENDS}),
    _S.ABORTED: frozenset({_S.FINISHED}),
    _S.FINISHED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A request was moved where its state does not lead: a bug in the router."""


def check_transition(request_id: str, current: RequestState, target: RequestState) -> None:
    """Raise IllegalTransition (and log it) unless `TRANSITIONS` allows `current` -> `target`."""
    if target not in TRANSITIONS[current]:
        logger.error(
            "request %s: %s -> %s is not a transition the router allows", request_id, current, target
        )
        raise IllegalTransition(f"request {request_id}: {current.name} -> {target.name}")
