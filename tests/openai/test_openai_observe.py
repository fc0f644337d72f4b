"""The OpenAI port's request ids, access log and CORS (server/openai/observe.py), over a fake engine."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest
from conftest import FakeEngine, serve_app

from harness.waiting import wait_for
from server.openai.app import build_app
from server.openai.observe import CORSSettings

ORIGIN = "https://chat.example"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "content-type",
}
DISAGG = "/v1/strata/models/fake/disagg"


@pytest.fixture
def cors_url(request) -> Iterator[str]:
    """The frontend with CORS for ORIGIN; `admin_routes` from the test's parameter (default False)."""
    admin = getattr(request, "param", False)
    cors = CORSSettings((ORIGIN,), admin_routes=admin)
    with serve_app(build_app({"fake": FakeEngine()}, cors=cors)) as url:
        yield url


def test_without_allowed_origins_no_cors_header_is_sent(served) -> None:
    preflight = httpx.options(f"{served.base_url}/v1/chat/completions", headers=PREFLIGHT, timeout=10)
    assert "access-control-allow-origin" not in preflight.headers
    models = httpx.get(f"{served.base_url}/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert models.status_code == 200 and "access-control-allow-origin" not in models.headers


def test_an_allowed_origin_gets_cors_headers_and_another_does_not(cors_url: str) -> None:
    preflight = httpx.options(f"{cors_url}/v1/chat/completions", headers=PREFLIGHT, timeout=10)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    other = httpx.options(
        f"{cors_url}/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"}, timeout=10
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
    answer = httpx.post(f"{cors_url}/v1/completions", json=body, headers={"Origin": ORIGIN}, timeout=10)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN


def test_admin_routes_stay_closed_to_browsers_unless_asked(cors_url: str) -> None:
    preflight = httpx.options(
        f"{cors_url}{DISAGG}", headers={**PREFLIGHT, "Access-Control-Request-Method": "PUT"}
    )
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    read = httpx.get(f"{cors_url}{DISAGG}", headers={"Origin": ORIGIN}, timeout=10)
    assert (
        "access-control-allow-origin" not in read.headers
    )  # answered (a 404 here: fake is not disaggregated)


@pytest.mark.parametrize("cors_url", [True], indirect=True)
def test_cors_admin_routes_opens_them_to_the_allowed_origin(cors_url: str) -> None:
    preflight = httpx.options(
        f"{cors_url}{DISAGG}", headers={**PREFLIGHT, "Access-Control-Request-Method": "PUT"}
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN


def test_every_answer_has_a_request_id_and_an_access_log_line(served, caplog) -> None:
    caplog.set_level(logging.INFO, logger="strata.access")
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
    answer = httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=10)
    missing = httpx.get(f"{served.base_url}/v1/models/nope", headers={"X-Request-Id": "mine 1"}, timeout=10)
    ids = [answer.headers["x-request-id"], missing.headers["x-request-id"]]
    assert answer.json()["id"] == f"cmpl-{ids[0]}"  # the generation's id is the request's
    assert len(set(ids)) == 2 and all(len(i) == 32 for i in ids)
    wait_for(
        lambda: sum(r.name == "strata.access" for r in caplog.records) >= 2,
        10,
        what="two access lines (after the answers)",
    )
    access = [r.getMessage() for r in caplog.records if r.name == "strata.access"]
    lines = sorted(access, key=lambda m: "/v1/models" in m)
    assert '"POST /v1/completions" 200' in lines[0] and f"request_id={ids[0]}" in lines[0]
    assert '"GET /v1/models/nope" 404' in lines[1] and f"request_id={ids[1]}" in lines[1]
    assert "client_request_id" not in lines[1]  # "mine 1" has a space: not copied into the log
