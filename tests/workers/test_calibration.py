"""Calibration at worker start: workers on one host take turns, so they do not slow each other's measurement."""

from __future__ import annotations

import fcntl
import threading

from server.workers.hardware import CALIBRATION_LOCK, Speeds, calibrate
from tests.workers.worker_fakes import StepEngine


def test_calibration_waits_for_another_on_the_same_host() -> None:
    result: list[Speeds] = []
    with open(CALIBRATION_LOCK, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another worker calibrating
        thread = threading.Thread(target=lambda: result.append(calibrate(StepEngine())))
        thread.start()
        thread.join(0.5)
        assert thread.is_alive() and not result
    thread.join(10)
    assert result == [Speeds()]  # the step engine's 4-token blocks are too small to measure: zeros
