"""Sentence embeddings from all-MiniLM-L6-v2's token states, as sentence-transformers' Pooling(mean) and
Normalize compute them: last_hidden_state (FP32 [batch, tokens, 384]) and attention_mask (INT64 [batch, tokens])
-> EMBEDDING (FP32 [batch, 384]), the mean of the states whose mask is 1, scaled to L2 norm 1."""

import numpy as np
import triton_python_backend_utils as pb_utils

MIN_TOKENS = 1e-9  # sentence-transformers' clamp on the token count (a text of padding only gives zeros)
MIN_NORM = 1e-12  # torch.nn.functional.normalize's eps


def embed(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    weights = mask[:, :, None].astype(np.float32)
    mean = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), MIN_TOKENS)
    return mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), MIN_NORM)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            hidden = pb_utils.get_input_tensor_by_name(request, "last_hidden_state").as_numpy()
            mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            embedding = pb_utils.Tensor("EMBEDDING", embed(hidden, mask).astype(np.float32))
            responses.append(pb_utils.InferenceResponse([embedding]))
        return responses
