"""An engine that cannot take a request, served through real Triton: the LLM model's error goes out as UNAVAILABLE,
as tritonserver's own full queue does (fake engines, no weights: the test takes seconds)."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from harness.ports import free_port
from server.backends.llm import bind_engine
from server.engine.api import EngineOverloaded, EngineUnavailable, GenerationRequest, OutputSink, RequestId
from server.triton import TritonServer, TritonSettings

REFUSALS = {
    "full": EngineOverloaded("full: 1 requests are waiting (max_queued_requests); retry later", 2.0),
    "down": EngineUnavailable("no worker is alive"),
}


class RefusingEngine:
    """The parts of the Engine protocol the Triton binding uses; every submit raises `refusal`."""

    max_model_len = 64
    max_tokens_limit = 64

    def __init__(self, model_name: str, refusal: Exception) -> None:
        self.model_name = model_name
        self.refusal = refusal

    def encode(self, text: str) -> list[int]:
        return [1] * len(text.split())

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        raise self.refusal

    def abort(self, request_id: RequestId) -> None:
        pass


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("STRATA_RUNTIME_DIR", str(tmp_path_factory.mktemp("runtime")))
        env.setenv("LD_LIBRARY_PATH", "")  # start() prepends libpython's folder: restored afterwards
        ports = {f"{kind}_port": free_port() for kind in ("http", "grpc", "metrics")}
        server = TritonServer(TritonSettings(**ports, address="127.0.0.1"))
        server.start()
        try:
            for name, refusal in REFUSALS.items():
                bind_engine(server, name, 1, RefusingEngine(name, refusal))  # type: ignore[arg-type]
            yield server
        finally:
            server.stop()


def text_input(prompt: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    return tensor


@pytest.mark.parametrize("model", sorted(REFUSALS))
def test_a_refused_request_ends_a_grpc_stream_with_unavailable(triton: TritonServer, model: str) -> None:
    """With tritonserver's `triton_grpc_error` header a stream's error comes as the gRPC status."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{triton.config.grpc_port}")
    errors: queue.Queue = queue.Queue()
    try:
        client.start_stream(lambda result, error: errors.put(error), headers={"triton_grpc_error": "true"})
        client.async_stream_infer(model, [text_input("The three primary colors are")])
        error = errors.get(timeout=30)
    finally:
        client.stop_stream()
        client.close()
    assert str(error.status()) == "StatusCode.UNAVAILABLE", error
    assert str(REFUSALS[model]) in error.message()


def test_a_full_queue_over_http_generate_names_the_class(triton: TritonServer) -> None:
    """Triton 2.51's generate endpoint answers 400 to every error a model sends (it reads the error's code after
    freeing it), so the class name in the message is what tells a client to retry."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{triton.config.http_port}/v2/models/full/generate",
        data=json.dumps({"text_input": "The three primary colors are"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    body = refused.value.read().decode()
    assert refused.value.code == 400 and "TritonUnavailableError: " in body and "max_queued_requests" in body
