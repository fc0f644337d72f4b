"""The documentation site: its generated reference is what the code says, and it builds strictly (no broken link,
no page left out of the nav)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location(
        "generate_reference", ROOT / "docs" / "generate_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_page_is_what_the_code_generates() -> None:
    generator = _generator()
    assert generator.PAGE.read_text() == generator.page(), (
        "stale: run .venv/bin/python docs/generate_reference.py"
    )


def test_every_flag_and_model_json_key_is_in_the_reference() -> None:
    page = (ROOT / "docs" / "reference.md").read_text()
    for flag in ("--kvbm-host-cache-gb", "--tool-call-parser", "--chat-template", "--accept-remote-workers"):
        assert f"`{flag}`" in page
    for key in ("max_num_batched_tokens", "served_model_name", "host_cache_gb", "tensor_parallel_size"):
        assert f"| `{key}` |" in page


def test_the_site_builds_strictly(tmp_path) -> None:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    built = subprocess.run(
        [str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "index.html").exists()
