"""Runs inside Triton's Python backend: serves a TorchScript module the way Triton's libtorch backend does.

Inputs are passed to `forward` in the order of their `__<index>` suffix (config order when names carry none);
outputs are matched the same way. Requests of one dynamic batch run as one call, concatenated on the batch axis.
"""

import json
import re
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

MODEL_FILE = (
    "strata_model.pt"  # the link Strata stages to the operator's TorchScript file (backends/pytorch.py)
)


def _ordered(tensors):
    def key(item):
        index, entry = item
        match = re.search(r"__(\d+)$", entry["name"])
        return int(match.group(1)) if match else index

    return [entry["name"] for _, entry in sorted(enumerate(tensors), key=key)]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        path = Path(args["model_repository"]) / args["model_version"] / MODEL_FILE
        self.module = torch.jit.load(str(path), map_location="cpu").eval()
        self.inputs = _ordered(config["input"])
        self.outputs = _ordered(config["output"])
        self.batched = config.get("max_batch_size", 0) > 0

    def execute(self, requests):
        try:
            arrays = [
                [pb_utils.get_input_tensor_by_name(r, name).as_numpy() for r in requests]
                for name in self.inputs
            ]
            if self.batched:
                sizes = [a.shape[0] for a in arrays[0]]
                results = self._run([np.concatenate(parts) for parts in arrays])
                splits = np.cumsum(sizes)[:-1]
                per_request = [np.split(r, splits) for r in results]
                return [self._response([outs[i] for outs in per_request]) for i in range(len(requests))]
            return [self._response(self._run([parts[i] for parts in arrays])) for i in range(len(requests))]
        except Exception as exc:  # a bad request must not take the model down: report it on each request
            error = pb_utils.TritonError(f"torchscript forward failed: {exc}")
            return [pb_utils.InferenceResponse(error=error) for _ in requests]

    def _run(self, arrays):
        with torch.inference_mode():
            result = self.module(*[torch.from_numpy(np.ascontiguousarray(a)) for a in arrays])
        results = result if isinstance(result, (tuple, list)) else [result]
        return [r.detach().cpu().numpy() for r in results]

    def _response(self, results):
        return pb_utils.InferenceResponse(
            [pb_utils.Tensor(n, r) for n, r in zip(self.outputs, results, strict=True)]
        )
