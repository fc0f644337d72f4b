"""The command line hands each command's entry point typed options (server/options.py), never the Namespace."""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

import msgspec
import pytest

import server.cli
import server.serve
import server.workers.remote_worker
from kvbm.cli import ServiceOptions
from server.cli import build_parser, command_options, main
from server.options import EngineFlags, PlannerOptions, ProfileOptions, ServeOptions, WorkerOptions

COMMANDS = {
    "serve": (
        ["serve", "--model-repository", "a", "--model-repository", "b", "--workers", "2"],
        ServeOptions,
    ),
    "worker": (
        ["worker", "--model-repository", "repo", "--model", "m", "--redis-url", "redis://127.0.0.1:1"],
        WorkerOptions,
    ),
    "planner": (
        ["planner", "--model", "m", "--metrics-url", "http://127.0.0.1:1/metrics", "--profile", "p.json"],
        PlannerOptions,
    ),
    "profile": (
        ["profile", "--model-repository", "repo", "--model", "m", "--output", "p.json"],
        ProfileOptions,
    ),
    "kvbm": (["kvbm", "--redis-url", "redis://127.0.0.1:1"], ServiceOptions),
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _leaf_fields(cls: type[msgspec.Struct]) -> set[str]:
    names = set()
    for field in msgspec.structs.fields(cls):
        group = isinstance(field.type, type) and issubclass(field.type, msgspec.Struct)
        names |= _leaf_fields(field.type) if group else {field.name}
    return names


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_a_command_is_a_field_of_its_options(command: str) -> None:
    dests = {a.dest for a in _subparsers(build_parser())[command]._actions if a.dest != "help"}
    assert dests == _leaf_fields(COMMANDS[command][1])


def test_options_are_typed_and_carry_the_flags() -> None:
    parser = build_parser()
    serve = command_options(
        parser.parse_args(COMMANDS["serve"][0] + ["--max-model-len", "1024", "--no-kvbm"])
    )
    assert isinstance(serve, ServeOptions)
    assert serve.model_repository == (Path("a"), Path("b")) and serve.workers == 2
    assert serve.engine == EngineFlags(context_length=1024) and serve.tiers.kvbm is False
    assert serve.tiers.kvbm_flush_secs == 5.0 and serve.sla.adjustment_interval == 30.0
    worker = command_options(parser.parse_args(COMMANDS["worker"][0] + ["--role", "decode"]))
    assert isinstance(worker, WorkerOptions)
    assert worker.model_repository == Path("repo") and worker.role == "decode" and worker.lease_secs == 3.0
    planner = command_options(parser.parse_args(COMMANDS["planner"][0] + ["--deployment", "decode=d"]))
    assert isinstance(planner, PlannerOptions)
    assert planner.profile == Path("p.json") and planner.deployment == ("decode=d",)
    assert planner.sla.follow_last is True and planner.connector == "local"
    with pytest.raises(AttributeError):  # parsed once, never changed
        serve.workers = 3  # type: ignore[misc]


def test_serve_worker_planner_and_profile_entry_points_receive_typed_options(monkeypatch) -> None:
    received: dict[str, object] = {}

    def entry(name: str):
        def record(options, *rest):
            received[name] = options
            return 0

        return record

    monkeypatch.setattr(server.serve, "serve", entry("serve"))
    monkeypatch.setattr(server.workers.remote_worker, "run_worker", entry("worker"))
    monkeypatch.setattr(server.cli, "run_planner", entry("planner"))
    monkeypatch.setattr(server.cli, "run_profile", entry("profile"))
    monkeypatch.setenv("STRATA_CLUSTER_SECRET", secrets.token_hex(32))  # `strata worker` needs one
    monkeypatch.setenv(
        "OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    )  # main sets it for worker
    for command in ("serve", "worker", "planner", "profile"):
        argv, options_type = COMMANDS[command]
        assert main(argv) == 0
        assert type(received[command]) is options_type, command
    assert received["serve"].http_port == 8000 and received["worker"].model == "m"
    assert received["planner"].metrics_url.endswith("/metrics") and received["profile"].repeats == 3
