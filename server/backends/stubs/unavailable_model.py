"""Runs inside Triton's Python backend for a model whose folder Strata rejected: fails `initialize` with the reason.

Without a `strata_error` parameter the model loads (and answers every request with an error): Strata loads it so
once, then unloads it, to retire a failed model (see server.backends.unavailable.retire).
"""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        error = config.get("parameters", {}).get("strata_error")
        if error is not None:
            raise pb_utils.TritonModelException(error["string_value"])

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(error=pb_utils.TritonError("model is unavailable")) for _ in requests
        ]
