"""What Strata changes in PyTriton, and why (applied once, before Triton starts).

Readiness: PyTriton waits for the server to be *ready* at start, before each model load and after each unload.
Under strict readiness (tritonserver's default, and Strata's) a model that failed to load keeps the server not
ready, so every later bind (an LLM model, a poll-mode change) would wait out PyTriton's 120 s timeout and fail.
Strata's loads need only a live server: PyTriton's waits check liveness.
"""

from __future__ import annotations

import time

import pytriton.models.manager as pytriton_manager
import pytriton.triton as pytriton_triton


def apply() -> None:
    """Point PyTriton's readiness waits at liveness (idempotent)."""
    if getattr(pytriton_manager, "_strata_patched", False):
        return
    _wait_on_liveness()
    pytriton_manager._strata_patched = True


def wait_for_server_live(client, timeout_s: float | None = None, headers: dict | None = None) -> None:
    deadline = time.monotonic() + (timeout_s or 60.0)
    while True:
        try:
            if client.is_server_live(headers=headers):
                return
        except Exception:  # noqa: BLE001 - connection errors while Triton starts
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"Triton not live within {timeout_s} s")
        time.sleep(0.05)  # only while Triton starts: it is live from its first answer on


def _wait_on_liveness() -> None:
    class LiveModelClient(pytriton_manager.ModelClient):
        def wait_for_server(self, timeout_s: float) -> None:
            wait_for_server_live(self._general_client, timeout_s)

    pytriton_manager.wait_for_server_ready = wait_for_server_live
    pytriton_triton.wait_for_server_ready = wait_for_server_live  # run() waits for the server it started
    pytriton_manager.ModelClient = LiveModelClient
