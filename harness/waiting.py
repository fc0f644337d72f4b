"""Waiting on a condition with a deadline, instead of sleeping a guessed time."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(
    condition: Callable[[], bool], timeout: float, interval: float = 0.1, what: str = "condition"
) -> float:
    """Wait until `condition()` is true, checking every `interval` seconds; the seconds it took, TimeoutError after
    `timeout` s."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if condition():
            return time.monotonic() - started
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
