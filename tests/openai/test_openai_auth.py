"""`--api-key` on the OpenAI port: `/v1/*` needs the bearer key, in OpenAI's error shape otherwise."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from server.openai.app import build_app
from server.openai.metrics import FrontendMetrics
from tests.openai.conftest import FakeEngine, serve_app

KEY = "sk-test-7f3a"


@pytest.fixture
def base_url(fake_engine: FakeEngine) -> Iterator[str]:
    app = build_app({"fake": fake_engine}, FrontendMetrics.create(CollectorRegistry()), api_key=KEY)
    with serve_app(app) as url:
        yield url


def test_the_right_key_is_served_streaming_included(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["fake"]
    stream = client.completions.create(model="fake", prompt="hi", max_tokens=3, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == " t0 t1 t2"


@pytest.mark.parametrize("key", ["wrong", KEY + "x", ""])
def test_a_wrong_or_missing_key_gets_401_in_openais_shape(base_url: str, key: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key or "placeholder", max_retries=0)
    if not key:  # no Authorization header at all
        client = openai.OpenAI(
            base_url=f"{base_url}/v1", api_key="x", max_retries=0, default_headers={"Authorization": ""}
        )
    with pytest.raises(openai.AuthenticationError) as caught:
        client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert caught.value.status_code == 401
    assert caught.value.body["code"] == "invalid_api_key"
    assert caught.value.body["type"] == "invalid_request_error"


def test_health_and_metrics_stay_open(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert httpx.get(f"{base_url}/metrics").status_code == 200
    unauthenticated = httpx.post(f"{base_url}/v1/completions", json={"model": "fake", "prompt": "x"})
    assert unauthenticated.status_code == 401
    assert unauthenticated.headers["www-authenticate"] == "Bearer"
    assert unauthenticated.json()["error"]["code"] == "invalid_api_key"
