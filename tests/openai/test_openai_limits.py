"""Request bounds of the OpenAI frontend (--max-request-bytes, --max-n, --max-prompts-per-request,
--max-seqs-per-request, characters per context), checked before any tokenizing; text that is not valid Unicode."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from server.cli import main as strata_main
from server.openai.app import build_app
from server.openai.limits import RequestLimits
from server.openai.metrics import FrontendMetrics
from tests.openai.conftest import FakeEngine, serve_app

LIMITS = RequestLimits(max_request_bytes=64 * 1024, max_n=3, max_prompts=4, max_seqs=6)


class CountingEngine(FakeEngine):
    """Counts what reaches the tokenizer."""

    def __init__(self) -> None:
        super().__init__()
        self.encoded = 0

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return super().encode(text)


@pytest.fixture
def engine() -> CountingEngine:
    return CountingEngine()


@pytest.fixture
def base_url(engine: CountingEngine) -> Iterator[str]:
    app = build_app({"fake": engine}, FrontendMetrics.create(CollectorRegistry()), api_key="k", limits=LIMITS)
    with serve_app(app) as url:
        yield url


def post(base_url: str, body: dict | bytes, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    headers = {"Authorization": "Bearer k", "Content-Type": "application/json", **kwargs.pop("headers", {})}
    if isinstance(body, dict):
        return httpx.post(f"{base_url}{path}", json=body, headers=headers, timeout=30, **kwargs)
    return httpx.post(f"{base_url}{path}", content=body, headers=headers, timeout=30, **kwargs)


def assert_refused(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return error


def test_a_body_over_the_limit_is_413_declared_or_chunked(base_url: str, engine: CountingEngine) -> None:
    big = {"model": "fake", "prompt": "x" * 70_000}
    error = assert_refused(post(base_url, big), 413, None)
    assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts what arrives
        yield b'{"model": "fake", "prompt": "'
        for _ in range(70):
            yield b"x" * 1000
        yield b'"}'

    assert_refused(post(base_url, chunks()), 413, None)
    small = post(base_url, iter([b'{"model": "fake", ', b'"prompt": "hi", "max_tokens": 2}']))
    assert small.status_code == 200 and small.json()["choices"][0]["text"] == " t0 t1"
    assert engine.encoded == 1


def test_the_api_key_is_checked_before_the_body(base_url: str) -> None:
    response = httpx.post(f"{base_url}/v1/completions", content=b"x" * 100_000, timeout=30)
    assert response.status_code == 401


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"n": 4, "prompt": "hi"}, "n", "--max-n"),
        ({"prompt": ["a"] * 5}, "prompt", "--max-prompts-per-request"),
        ({"n": 2, "prompt": ["a", "b", "c", "d"]}, "n", "--max-seqs-per-request"),
        ({"n": 2, "prompt": [[1, 2], [3], [4], [5]]}, "n", "--max-seqs-per-request"),
        ({"prompt": "x" * (256 * 128 + 1)}, "prompt", "context of 256 tokens"),
        ({"prompt": ["ok", "x" * (256 * 128 + 1)]}, "prompt", "context of 256 tokens"),
    ],
)
def test_bounds_name_the_field_before_tokenizing(
    base_url: str, engine: CountingEngine, body: dict, param: str, words: str
) -> None:
    with_model = {"model": "fake", "max_tokens": 1, **body}
    error = assert_refused(post(base_url, with_model), 400, param)
    assert words in error["message"]
    assert engine.encoded == 0 and not engine.submitted


def test_chat_bounds(base_url: str, engine: CountingEngine) -> None:
    messages = [{"role": "user", "content": "x" * (128 * 128)}] * 3  # 49,152 characters together
    error = assert_refused(
        post(base_url, {"model": "fake", "messages": messages}, "/v1/chat/completions"), 400, "messages"
    )
    assert "context" in error["message"]
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "n": 4}
    assert_refused(post(base_url, body, "/v1/chat/completions"), 400, "n")
    body["n"] = 3
    assert post(base_url, {**body, "max_tokens": 1}, "/v1/chat/completions").status_code == 200


def test_n_x_prompts_within_the_limits_is_served(base_url: str) -> None:
    reply = post(base_url, {"model": "fake", "prompt": ["a", "b"], "n": 3, "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 6


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", b'{"model": "fake", "prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", b'{"model": "fake", "prompt": ["ok", "\\udfff"]}', "prompt"),
        ("/v1/completions", b'{"model": "\\ud800", "prompt": "hi"}', "model"),
        ("/v1/completions", b'{"model": "fake", "prompt": "hi", "stop": ["\\ud800"]}', "stop"),
        (
            "/v1/chat/completions",
            b'{"model": "fake", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
            "messages.0.content.0.text",
        ),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(
    base_url: str, path: str, body: bytes, param: str
) -> None:
    """JSON may escape half a surrogate pair; no tokenizer takes it (it was a 500), nor can an error echo it."""
    error = assert_refused(post(base_url, body, path), 400, param)
    assert "Unicode" in error["message"]


def test_wrong_method_is_405_with_allow(base_url: str) -> None:
    response = httpx.put(f"{base_url}/health", timeout=30)
    assert response.status_code == 405 and response.headers["allow"] == "GET"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_the_openapi_schema_says_what_the_app_answers(base_url: str) -> None:
    schema = httpx.get(f"{base_url}/openapi.json", timeout=30).json()
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in completions and {"400", "413"} <= set(completions)
    assert "text/event-stream" in completions["200"]["content"]
    assert schema["components"]["schemas"]["CompletionRequest"]["properties"]["n"]["maximum"] == 3
    assert "HTTPValidationError" not in schema["components"]["schemas"]


@pytest.mark.parametrize(
    "flag", ["--max-request-bytes", "--max-n", "--max-prompts-per-request", "--max-seqs-per-request"]
)
def test_a_limit_flag_below_one_stops_strata_serve(flag: str, tmp_path, caplog) -> None:
    assert strata_main(["serve", "--model-repository", str(tmp_path), flag, "0"]) == 2
    assert f"{flag}: must be a positive integer" in caplog.text
