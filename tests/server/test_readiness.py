"""Strict readiness, as tritonserver's default: /v2/health/ready is false until the repository's models are
loaded, stays false while a model is broken, and comes back once the broken model is fixed or removed."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.error
import urllib.request

from harness.servers import copy_models
from harness.waiting import wait_for


def status(url: str) -> int | None:
    try:
        return urllib.request.urlopen(url, timeout=5).status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None  # not listening yet


def index(server) -> dict[str, dict]:
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/repository/index", data=b"{}", method="POST"
    )
    return {row["name"]: row for row in json.loads(urllib.request.urlopen(request, timeout=5).read())}


def test_server_is_not_ready_before_every_model_is(strata, tmp_path):
    """Probes the server while it starts: no probe sees the server ready with a model not yet ready."""
    repo = copy_models(tmp_path / "repo", "add_sub", "string_upper")
    server = strata(repo, wait_ready=False)
    base = f"http://{server.http_url}/v2"
    samples: list[tuple[int | None, int | None, int | None]] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            samples.append(
                (
                    status(f"{base}/health/ready"),
                    status(f"{base}/models/add_sub/ready"),
                    status(f"{base}/models/string_upper/ready"),
                )
            )
            done.wait(0.02)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        wait_for(lambda: bool(samples) and samples[-1][0] == 200, 120, what="server ready")
    finally:
        done.set()
        prober.join()
    ready_early = [s for s in samples if s[0] == 200 and s[1:] != (200, 200)]
    assert not ready_early, ready_early
    assert any(s[0] == 400 for s in samples if s[0] is not None)  # the probes did see the loading phase
    # the placeholder is unloaded (ready turns true) a moment before its folder, which the index lists, is removed
    wait_for(lambda: "strata_loading_repository" not in index(server), 10, what="the placeholder gone")


def test_a_broken_model_keeps_the_server_not_ready_until_removed(strata, tmp_path):
    """A model whose config names another model (Triton QA's wrong_model) is listed UNAVAILABLE with the reason,
    the server is not ready while it is there, and ready again once it is gone (poll mode)."""
    repo = copy_models(tmp_path / "repo", "add_sub")
    wrong = repo / "wrong_model"
    shutil.copytree(repo / "add_sub", wrong)
    config = (wrong / "config.pbtxt").read_text()
    (wrong / "config.pbtxt").write_text(config.replace('name: "add_sub"', 'name: "not_wrong_model"'))
    server = strata(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.3")
    row = index(server)["wrong_model"]
    assert row["state"] == "UNAVAILABLE" and "not_wrong_model" in row["reason"], row
    assert status(f"http://{server.http_url}/v2/models/add_sub/ready") == 200
    assert status(f"http://{server.http_url}/v2/health/ready") == 400
    shutil.rmtree(wrong)
    wait_for(lambda: status(f"http://{server.http_url}/v2/health/ready") == 200, 60, what="ready again")
