"""served_model_name in model.json (vLLM's key): the OpenAI API serves the model under each name, lists them, and
labels the frontend's series with the first; Triton keeps the model's folder name."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_workers import metric_lines

from harness.servers import copy_models, start_strata
from server.engine.config import served_names

pytestmark = pytest.mark.slow


def test_served_names_are_checked() -> None:
    assert served_names(None, "smollm2") == ("smollm2",)
    assert served_names("smol", "smollm2") == ("smol",)
    assert served_names(["a", "b"], "smollm2") == ("a", "b")
    for bad in ([], ["a", "a"], [""]):
        with pytest.raises(ValueError, match="served_model_name"):
            served_names(bad, "smollm2")


def test_a_model_served_under_its_served_names(tmp_path) -> None:
    repo = copy_models(tmp_path / "repo", "smollm2")
    model_json = repo / "smollm2" / "1" / "model.json"
    settings = json.loads(model_json.read_text())
    model_json.write_text(json.dumps({**settings, "served_model_name": ["smol", "smol-alias"]}))
    server = start_strata(repo, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{server.openai_url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smol", "smol-alias"]
        for name in ("smol", "smol-alias"):
            reply = client.completions.create(model=name, prompt="Hello", max_tokens=2, temperature=0)
            assert reply.model == name and reply.usage.completion_tokens == 2
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="smollm2", prompt="Hello", max_tokens=2)
        successes = metric_lines(server, "strata_requests_total")
        assert successes['strata_requests_total{model="smol",status="success"}'] == 2
        generate = httpx.post(
            f"http://{server.http_url}/v2/models/smollm2/generate",
            json={"text_input": "Hello", "parameters": {"max_tokens": 2}},
            timeout=60,
        )
        assert generate.status_code == 200  # Triton: the folder's name
    finally:
        server.stop()
