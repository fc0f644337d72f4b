"""Triton Python-backend model, unchanged from what runs on stock Triton."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.scale = np.float32(int(args["model_version"]))
        self.out_dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, "OUTPUT0")["data_type"]
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            if a.shape != b.shape:
                error = pb_utils.TritonError(f"INPUT0 shape {a.shape} and INPUT1 shape {b.shape} differ")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            out0 = ((a + b) * self.scale).astype(self.out_dtype)
            out1 = ((a - b) * self.scale).astype(self.out_dtype)
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", out0), pb_utils.Tensor("OUTPUT1", out1)]
                )
            )
        return responses

    def finalize(self):
        pass
