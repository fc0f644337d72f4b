"""The import rules between Strata's parts (docs/ARCHITECTURE.md), as contracts in pyproject.toml.

import-linter checks them on the real import graph (grimp), so a new `from server.router import ...` inside kvbm or
the engine fails here, not in a review.
"""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import server.engine
import server.openai

ROOT = Path(__file__).resolve().parents[1]


def _contracts() -> list[dict]:
    with open(ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["tool"]["importlinter"]["contracts"]


def test_import_contracts_are_kept():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run(
        [str(lint_imports), "--no-cache", "pyproject.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[result.stdout.find("Broken contracts") :] + result.stderr


def test_every_installed_package_is_in_the_import_graph():
    """What setuptools installs (server, kvbm and cluster, what the two share) are root packages of the contracts,
    so no import between them escapes a rule; cluster imports neither of the others."""
    with open(ROOT / "pyproject.toml", "rb") as file:
        config = tomllib.load(file)
    find = config["tool"]["setuptools"]["packages"]["find"]
    installed = {pattern.rstrip("*") for pattern in find["include"]}
    assert installed == {"server", "kvbm", "cluster"}
    assert installed <= set(config["tool"]["importlinter"]["root_packages"])
    cluster = next(c for c in _contracts() if c["source_modules"] == ["cluster"])
    assert set(cluster["forbidden_modules"]) == {"server", "kvbm"}


def test_the_frontend_rule_names_every_engine_module_but_the_protocol():
    """The frontend contract lists server.engine's modules one by one; a new engine module must be added there."""
    engine_modules = {f"server.engine.{info.name}" for info in pkgutil.iter_modules(server.engine.__path__)}
    frontend = next(c for c in _contracts() if c["source_modules"] == ["server.openai"])
    forbidden = set(frontend["forbidden_modules"])
    assert engine_modules - forbidden == {"server.engine.api"}


def test_every_frontend_module_is_a_route_or_shared():
    """server.openai's modules are app.py, the route modules (which import none of each other) and the shared ones
    (which import no route module); a new module must be put in one of the two contracts."""
    frontend = [
        c for c in _contracts() if c.get("source_modules", c.get("modules"))[0].startswith("server.openai.")
    ]
    routes = next(c["modules"] for c in frontend if c["type"] == "independence")
    shared = next(c for c in frontend if c["type"] == "forbidden")
    assert set(shared["forbidden_modules"]) == set(routes)
    modules = {f"server.openai.{info.name}" for info in pkgutil.iter_modules(server.openai.__path__)}
    assert modules == {"server.openai.app", *routes, *shared["source_modules"]}


def test_the_protocol_and_the_frontend_load_without_the_engine():
    """Importing server.engine.api (what the frontend sees) must not load torch or the engine's modules."""
    probe = (
        "import sys, server.openai.app; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('server.engine.')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['server.engine.api']"


def test_neither_tests_nor_benchmarks_put_the_other_on_sys_path():
    """import-linter sees `from bench...`, not a folder put on sys.path and imported by its bare module name."""
    for folder, other in (("tests", "bench"), ("bench", "tests")):
        route = re.compile(rf"sys\.path\.\w+\(.*\b{other}\b")
        for path in (ROOT / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                assert not route.search(line), f"{path.relative_to(ROOT)}:{number}: {line}"
