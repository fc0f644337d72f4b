"""What Strata changes in PyTriton, and why (applied once, before Triton starts).

Readiness: PyTriton waits for the server to be *ready* at start, before each model load and after each unload.
Under strict readiness (tritonserver's default, and Strata's) a model that failed to load keeps the server not
ready, so every later bind (an LLM model, a poll-mode change) would wait out PyTriton's 120 s timeout and fail.
Strata's loads need only a live server: PyTriton's waits check liveness.

Flags: PyTriton's `TritonConfig` knows no --strict-model-config or --rate-limit; `CoreConfig` adds them (the
tritonserver flags Triton's core needs for auto-complete and the rate limiter).

Error codes: PyTriton's proxy model (the model.py it writes into the store for each bound callable) sends every
error its callable raises with code INTERNAL. The copy it writes gets one change: an error raised as a
`TritonUnavailableError` (the class name starts the message) goes out as UNAVAILABLE, as tritonserver's own full
queue does; a gRPC stream opened with the `triton_grpc_error: true` header then ends with status UNAVAILABLE.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytriton.models.manager as pytriton_manager
import pytriton.models.model as pytriton_model
import pytriton.triton as pytriton_triton
from pytriton.server.triton_server_config import TritonServerConfig

# how PyTriton formats the message of server.backends.llm's TritonUnavailableError (no traceback, no module)
_UNAVAILABLE_PREFIX = "TritonUnavailableError: "
# how PyTriton 0.7.0's proxy/model.py builds the error of a decoupled model's response
_PROXY_ERROR = 'error=pb_utils.TritonError(responses_payload.decode("utf-8"))'
_PROXY_ERROR_WITH_CODE = 'error=_strata_triton_error(responses_payload.decode("utf-8"))'
_PROXY_ERROR_FUNCTION = f"""

def _strata_triton_error(message):
    \"\"\"Added by Strata (server/pytriton_patches.py): the error with Triton's code for its class.\"\"\"
    if message.startswith({_UNAVAILABLE_PREFIX!r}):
        return pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE)
    return pb_utils.TritonError(message)
"""


_CORE_FLAGS = ("strict-model-config", "rate-limit", "rate-limit-resource")


@dataclasses.dataclass
class CoreConfig(pytriton_triton.TritonConfig):
    """PyTriton's TritonConfig plus the tritonserver flags it lacks (None: tritonserver's default)."""

    strict_model_config: bool | None = None
    rate_limit: str | None = None
    rate_limit_resource: list[str] | None = None


def apply() -> None:
    """Point PyTriton's readiness waits at liveness and give proxy errors their code (idempotent)."""
    if getattr(pytriton_manager, "_strata_patched", False):
        return
    _wait_on_liveness()
    _proxy_sends_error_codes()
    pytriton_triton.TritonConfig = CoreConfig  # Triton() rebuilds its config through this name
    TritonServerConfig.server_arg_keys += [
        key for key in _CORE_FLAGS if key not in TritonServerConfig.server_arg_keys
    ]
    pytriton_manager._strata_patched = True


def wait_for_server_live(client, timeout_s: float | None = None, headers: dict | None = None) -> None:
    deadline = time.monotonic() + (timeout_s or 60.0)
    last_error = "it answered not live"
    while True:
        try:
            if client.is_server_live(headers=headers):
                return
        except Exception as exc:  # noqa: BLE001 - while Triton starts, any failure to answer means "not yet"
            last_error = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"Triton not live within {timeout_s} s (last: {last_error})")
        time.sleep(0.05)  # only while Triton starts: it is live from its first answer on


def _wait_on_liveness() -> None:
    class LiveModelClient(pytriton_manager.ModelClient):
        def wait_for_server(self, timeout_s: float) -> None:
            wait_for_server_live(self._general_client, timeout_s)

    pytriton_manager.wait_for_server_ready = wait_for_server_live
    pytriton_triton.wait_for_server_ready = wait_for_server_live  # run() waits for the server it started
    pytriton_manager.ModelClient = LiveModelClient


def _proxy_sends_error_codes() -> None:
    generate_model = pytriton_model.Model.generate_model

    def generate_with_error_codes(self: pytriton_model.Model, model_repository: Path) -> None:
        generate_model(self, model_repository)
        proxy = model_repository / self.model_name / str(self.model_version) / "model.py"
        proxy.write_text(_with_error_codes(proxy.read_text()))

    pytriton_model.Model.generate_model = generate_with_error_codes


def _with_error_codes(proxy_source: str) -> str:
    """PyTriton's proxy model.py with UNAVAILABLE for a TritonUnavailableError; fails loudly if PyTriton changed."""
    if proxy_source.count(_PROXY_ERROR) != 1:
        raise RuntimeError(
            f"PyTriton's proxy model.py does not build its errors with {_PROXY_ERROR!r} (once) any more: "
            "update server/pytriton_patches.py for this PyTriton version"
        )
    return proxy_source.replace(_PROXY_ERROR, _PROXY_ERROR_WITH_CODE) + _PROXY_ERROR_FUNCTION
