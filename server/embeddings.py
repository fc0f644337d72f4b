"""The repository's embedding models, as /v1/embeddings (server/openai/embeddings.py) sees them, run in Triton.

A model says it is one in its config.pbtxt:

    parameters { key: "openai_api" value: { string_value: "embeddings" } }

and then must batch (max_batch_size >= 1) and declare one input: its text (TYPE_STRING, dims [1]) or its token ids
(TYPE_INT32/TYPE_INT64, dims [-1]); and one floating-point output of dims [D] (the embedding), optionally with one
integer output of dims [1] (each input's token count, which the response's usage adds up). A declaration that does
not fit is the model's staging error, naming config.pbtxt and the field (the model is then UNAVAILABLE with it).
The example's minilm_embed ensemble is one.

`EmbeddingModels` is a live mapping (served name -> `TritonEmbedder`): `watch` wraps the repository's backends so
that staging a model with the declaration adds it and unloading it removes it. Each embed call is a Triton gRPC
inference on loopback (what `tritonclient` would send): text inputs in batches of max_batch_size sent together
(Triton's batcher joins them with other requests'), token-id inputs one per call (their lengths differ).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc.aio as grpc_aio
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from server.errors import ConfigError
from server.openai.embedder import EmbedderUnavailable
from server.repository.backend import BackendRegistry, ModelBackend
from server.repository.scan import ModelSource

PARAMETER = "openai_api"
_T = model_config_pb2.DataType
_FLOATS = {_T.TYPE_FP16: "FP16", _T.TYPE_FP32: "FP32", _T.TYPE_FP64: "FP64"}
_INTEGERS = {_T.TYPE_INT32: "INT32", _T.TYPE_INT64: "INT64"}


@dataclass(frozen=True, slots=True)
class EmbeddingSpec:
    """What /v1/embeddings needs of a model's config."""

    input_name: str
    input_dtype: str  # BYTES (text), INT32 or INT64 (token ids)
    output_name: str
    dimensions: int
    tokens_output: str | None  # each input's token count, if the model reports it
    max_batch_size: int

    @property
    def takes_tokens(self) -> bool:
        return self.input_dtype != "BYTES"


def embedding_spec(model: ModelSource) -> EmbeddingSpec | None:
    """The model's embedding declaration, None without one; ConfigError naming config.pbtxt and the field."""
    config = model.config
    if PARAMETER not in config.parameters:
        return None
    where = model.path / "config.pbtxt"
    value = config.parameters[PARAMETER].string_value
    if value != "embeddings":
        raise ConfigError(where, f'parameters "{PARAMETER}": the one value is "embeddings", not {value!r}')
    if config.max_batch_size < 1:
        raise ConfigError(
            where, "max_batch_size: an embedding model batches its inputs (give max_batch_size >= 1)"
        )
    if len(config.input) != 1:
        raise ConfigError(
            where, f"input: an embedding model has one input (text or token ids), not {len(config.input)}"
        )
    (given,) = config.input
    if given.data_type == _T.TYPE_STRING and list(given.dims) == [1]:
        dtype = "BYTES"
    elif given.data_type in _INTEGERS and list(given.dims) == [-1]:
        dtype = _INTEGERS[given.data_type]
    else:
        raise ConfigError(
            where,
            f"input {given.name!r}: text is TYPE_STRING with dims [1], token ids TYPE_INT32/64 with dims [-1]",
        )
    floats = [o for o in config.output if o.data_type in _FLOATS]
    counts = [o for o in config.output if o.data_type in _INTEGERS and list(o.dims) == [1]]
    if len(floats) != 1 or len(floats[0].dims) != 1 or floats[0].dims[0] < 1:
        raise ConfigError(
            where, "output: an embedding model has one floating-point output of dims [D] (the embedding)"
        )
    if len(counts) > 1 or len(floats) + len(counts) != len(config.output):
        raise ConfigError(
            where, "output: besides the embedding, at most one integer output of dims [1] (token counts)"
        )
    return EmbeddingSpec(
        given.name, dtype, floats[0].name, int(floats[0].dims[0]), counts[0].name if counts else None,
        config.max_batch_size,
    )  # fmt: skip


class TritonEmbedder:
    """One embedding model, run by Triton over gRPC on loopback (`connect` makes the client, in the running loop)."""

    def __init__(
        self,
        name: str,
        spec: EmbeddingSpec,
        connect: Callable[[], grpc_aio.InferenceServerClient],
        headers: dict[str, str] | None,
    ) -> None:
        self.name = name
        self.spec = spec
        self.dimensions = spec.dimensions
        self.takes_tokens = spec.takes_tokens
        self._connect = connect
        self._headers = headers
        self._client: grpc_aio.InferenceServerClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def embed(self, inputs: list[str] | list[list[int]]) -> tuple[np.ndarray, list[int] | None]:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client, self._loop = self._connect(), loop
        if self.takes_tokens:
            batches = [np.array([ids], dtype=self.spec.input_dtype.lower()) for ids in inputs]
        else:
            texts = np.array([[text.encode()] for text in inputs], dtype=np.object_)  # type: ignore[union-attr]
            size = self.spec.max_batch_size
            batches = [texts[i : i + size] for i in range(0, len(texts), size)]
        answers = await asyncio.gather(*(self._infer(self._client, batch) for batch in batches))
        vectors = np.concatenate([vectors for vectors, _ in answers]).astype(np.float32, copy=False)
        if self.spec.tokens_output is None:
            return vectors, None
        return vectors, [int(n) for _, counts in answers for n in counts.reshape(-1)]

    async def _infer(
        self, client: grpc_aio.InferenceServerClient, batch: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        tensor = grpc_aio.InferInput(self.spec.input_name, list(batch.shape), self.spec.input_dtype)
        tensor.set_data_from_numpy(batch)
        names = [self.spec.output_name] + ([self.spec.tokens_output] if self.spec.tokens_output else [])
        try:
            result = await client.infer(
                self.name,
                [tensor],
                outputs=[grpc_aio.InferRequestedOutput(n) for n in names],
                headers=self._headers,
            )
        except InferenceServerException as exc:
            raise EmbedderUnavailable(exc.message() or str(exc)) from None
        counts = result.as_numpy(self.spec.tokens_output) if self.spec.tokens_output else None
        return result.as_numpy(self.spec.output_name), counts

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


class EmbeddingModels(Mapping[str, TritonEmbedder]):
    """The embedding models staged now (served name -> embedder), kept in step with the repository by `watch`."""

    def __init__(
        self, connect: Callable[[], grpc_aio.InferenceServerClient], headers: dict[str, str] | None
    ) -> None:
        self._connect = connect
        self._headers = headers
        self._models: dict[str, TritonEmbedder] = {}

    def __getitem__(self, name: str) -> TritonEmbedder:
        return self._models[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._models))

    def __len__(self) -> int:
        return len(self._models)

    def watch(self, registry: BackendRegistry) -> BackendRegistry:
        """`registry` with every backend telling this mapping what it stages and unloads."""
        backends = {name: _Declaring(backend, self) for name, backend in registry.backends.items()}
        return BackendRegistry(backends, registry.placeholder)

    def declare(self, model: ModelSource, spec: EmbeddingSpec | None) -> None:
        if spec is None:
            self._models.pop(model.name, None)
        else:
            self._models[model.name] = TritonEmbedder(model.name, spec, self._connect, self._headers)

    def forget(self, name: str) -> None:
        self._models.pop(name, None)


class _Declaring:
    """A backend that also tells `EmbeddingModels` which of its models are embedding models."""

    def __init__(self, backend: ModelBackend, models: EmbeddingModels) -> None:
        self._backend = backend
        self._models = models

    def stage(self, model: ModelSource) -> None:
        spec = embedding_spec(model)  # a bad declaration fails the staging, naming the field
        self._backend.stage(model)
        self._models.declare(model, spec)

    def load(self, model: ModelSource) -> None:
        self._backend.load(model)

    def unload(self, name: str) -> None:
        self._models.forget(name)
        self._backend.unload(name)
