"""What callers hand the engine thread, and every request the engine has not finished.

Callers (any thread) `admit` a request, then `put` it (at once, or once its handoff's KV is fetched), and `abort`
one; the engine thread `wait`s for work, `take`s what arrived between steps and `forget`s a request when the core
finishes it. One condition, `lock`, guards it all (and whatever else must change with it at once: the engine's
view of its executor, server/engine/recovery.py); it is reentrant.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from server.engine.api import RequestError, RequestId
from server.engine.sequence import Sequence


class Inbox:
    def __init__(self) -> None:
        self.lock = threading.Condition()
        self._queued: list[Sequence] = []  # admitted and ready for the core, not yet taken
        self._aborts: list[RequestId] = []
        self._active: dict[RequestId, Sequence] = {}  # admitted, not finished: queued, fetching or running
        self._stopping = False

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def check_open(self) -> None:
        """Under `lock`, first of a submit's checks: RuntimeError once stopping."""
        if self._stopping:
            raise RuntimeError("engine is shut down")

    def check_new(self, request_id: RequestId) -> None:
        """Under `lock`: RequestError for an id that is already running."""
        if request_id in self._active:
            raise RequestError("request_id", f"{request_id!r} is already running")

    def admit(self, seq: Sequence) -> None:
        """Under `lock`, after the submit's checks: count `seq` as unfinished until the core finishes it."""
        self._active[seq.request_id] = seq

    def put(self, seq: Sequence) -> bool:
        """Queue an admitted `seq` for the engine thread; False (and not queued) if it ended meanwhile."""
        with self.lock:
            if self._stopping or seq.request_id not in self._active:
                return False
            self._queued.append(seq)
            self.lock.notify()
            return True

    def abort(self, request_id: RequestId) -> None:
        with self.lock:
            if request_id in self._active:
                self._aborts.append(request_id)
                self.lock.notify()

    def is_empty(self) -> bool:
        """True when no request is queued, running or unfinished."""
        with self.lock:
            return not self._active

    def stop(self) -> None:
        """Refuse new requests and wake the engine thread to end the unfinished ones."""
        with self.lock:
            self._stopping = True
            self.lock.notify()

    def wake(self) -> None:
        with self.lock:
            self.lock.notify()

    # ---- engine thread ----

    def wait(self, busy: Callable[[], bool]) -> None:
        """Under `lock`: until something is queued or aborted, the engine stops, or `busy()`."""
        with self.lock:
            while not (self._queued or self._aborts or self._stopping or busy()):
                self.lock.wait()

    def take(self) -> tuple[list[Sequence], list[Sequence], bool]:
        """What arrived since the last take: the new sequences, the unfinished sequences aborted, and whether the
        engine is stopping."""
        with self.lock:
            new, self._queued = self._queued, []
            aborts, self._aborts = self._aborts, []
            aborted = [self._active[i] for i in aborts if i in self._active]
            return new, aborted, self._stopping

    def unfinished(self, drop_queued: bool = False) -> list[Sequence]:
        """Every unfinished sequence; `drop_queued`: the queued ones will not reach the core."""
        with self.lock:
            if drop_queued:
                self._queued = []
            return list(self._active.values())

    def forget(self, request_id: RequestId) -> None:
        with self.lock:
            self._active.pop(request_id, None)
