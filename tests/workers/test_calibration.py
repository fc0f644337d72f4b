"""Calibration at worker start: workers on one host take turns, so they do not slow each other's measurement."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from harness.waiting import wait_for
from server.workers.hardware import CALIBRATION_LOCK, Speeds, calibrate
from tests.workers.worker_fakes import StepEngine


def flock_waiters(path: Path) -> int:
    """Processes or threads blocked in flock() on `path`, as the kernel lists them ("->" lines of /proc/locks)."""
    inode = f":{os.stat(path).st_ino} "
    return sum("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines())


def test_calibration_waits_for_another_on_the_same_host() -> None:
    result: list[Speeds] = []
    with open(CALIBRATION_LOCK, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another worker calibrating
        thread = threading.Thread(target=lambda: result.append(calibrate(StepEngine())))
        thread.start()
        # the kernel shows the calibration blocked on this lock: it waits however long the other one takes
        wait_for(
            lambda: flock_waiters(CALIBRATION_LOCK) == 1, 10, 0.01, what="calibration waiting on the lock"
        )
        assert thread.is_alive() and not result
    thread.join(10)
    assert result == [Speeds()]  # the step engine's 4-token blocks are too small to measure: zeros
