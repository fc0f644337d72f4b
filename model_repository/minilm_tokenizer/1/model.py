"""all-MiniLM-L6-v2's tokenizer as a Triton Python model: TEXT (BYTES [batch, 1], UTF-8) -> input_ids,
attention_mask, token_type_ids (INT64 [batch, tokens]) and num_tokens (INT64 [batch, 1]: each text's own).

Each text is at most sentence_bert_config.json's max_seq_length tokens, [CLS] and [SEP] included (longer ones are
truncated); a request's texts are padded with [PAD] (id 0, mask 0) to its longest, so `tokens` varies per request.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer


class TritonPythonModel:
    def initialize(self, args):
        folder = Path(args["model_repository"]) / args["model_version"]
        max_seq_length = json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"]
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length=max_seq_length)
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # no length: the longest text of each call

    def execute(self, requests):
        return [self._tokenize(request) for request in requests]

    def _tokenize(self, request):
        texts = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
        encodings = self.tokenizer.encode_batch([text.decode("utf-8") for text in texts])
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        types = np.array([e.type_ids for e in encodings], dtype=np.int64)
        return pb_utils.InferenceResponse(
            [
                pb_utils.Tensor("input_ids", ids),
                pb_utils.Tensor("attention_mask", mask),
                pb_utils.Tensor("token_type_ids", types),
                pb_utils.Tensor("num_tokens", mask.sum(axis=1, keepdims=True)),
            ]
        )
