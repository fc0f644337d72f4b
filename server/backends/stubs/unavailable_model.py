"""Runs inside Triton's Python backend for a model whose folder Strata rejected: fails `initialize` with the reason."""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        raise pb_utils.TritonModelException(config["parameters"]["strata_error"]["string_value"])

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(error=pb_utils.TritonError("model is unavailable")) for _ in requests
        ]
