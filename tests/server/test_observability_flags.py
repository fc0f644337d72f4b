"""The tracing, log and CORS flags of `strata serve` and `strata worker`, parsed and checked (no server runs)."""

from __future__ import annotations

import json
import logging

import pytest

from server import cli
from server.logs import JSONFormatter, LogSettings, configure_logging
from server.serve import cors_settings, triton_trace_config
from server.tracing import TracingSettings


def serve_options(*flags: str):
    return cli.command_options(cli.build_parser().parse_args(["serve", "--model-repository", "r", *flags]))


def test_tracing_flags_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="--otlp-traces-sample-ratio"):
        TracingSettings("http://collector:4318", 1.5)
    with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
        TracingSettings("collector:4317", 1.0)  # a gRPC address: Strata exports over OTLP/HTTP
    assert TracingSettings(None, 0.5).endpoint is None


def test_the_otlp_endpoint_turns_tritons_own_tracing_on_unless_trace_config_says_otherwise() -> None:
    options = serve_options(
        "--otlp-traces-endpoint", "http://collector:4318", "--otlp-traces-sample-ratio", "0.01"
    )
    assert triton_trace_config(options) == (
        "mode=opentelemetry", "opentelemetry,url=http://collector:4318/v1/traces", "rate=100", "level=TIMESTAMPS",
    )  # fmt: skip
    given = serve_options("--otlp-traces-endpoint", "http://c:4318", "--trace-config", "mode=triton")
    assert triton_trace_config(given) == ("mode=triton",)
    assert triton_trace_config(serve_options()) == ()
    assert (
        triton_trace_config(
            serve_options("--otlp-traces-endpoint", "http://c:4318", "--otlp-traces-sample-ratio", "0")
        )
        == ()
    )


def test_cors_is_off_without_allowed_origins_and_a_bad_list_is_refused(capsys) -> None:
    assert cors_settings(serve_options()) is None
    cors = cors_settings(serve_options("--allowed-origins", '["https://a.example"]', "--cors-admin-routes"))
    assert (
        cors.allowed_origins == ("https://a.example",)
        and cors.admin_routes
        and cors.allowed_methods == ("*",)
    )
    with pytest.raises(SystemExit):
        serve_options("--allowed-origins", "https://a.example")  # not JSON
    assert "--allowed-origins: not a JSON list of strings" in capsys.readouterr().err


def test_log_flags_reach_the_worker_command_and_json_lines_go_to_the_file(tmp_path) -> None:
    worker = cli.build_parser().parse_args(
        ["worker", "--model-repository", "r", "--model", "m", "--redis-url", "redis://x", "--log-format", "json",
         "--otlp-traces-endpoint", "http://c:4318"]
    )  # fmt: skip
    options = cli.command_options(worker)
    assert options.log_format == "json" and options.otlp_traces_endpoint == "http://c:4318"
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging(LogSettings(), logging.INFO, "worker-3")
        assert root.handlers == handlers  # the defaults leave a root logger the test runner configured alone
        configure_logging(LogSettings(str(tmp_path / "strata.log"), "json"), logging.INFO, "worker-3")
        logging.getLogger("strata.test").warning("hello %s", "there")
        (handler,) = [h for h in root.handlers if h not in handlers]
        assert isinstance(handler.formatter, JSONFormatter)
        handler.flush()
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(level)
    (line,) = [json.loads(text) for text in (tmp_path / "strata.log").read_text().splitlines()]
    assert line["message"] == "hello there" and line["process"] == "worker-3" and line["level"] == "WARNING"
    assert "request_id" not in line and "trace_id" not in line  # outside a request, tracing off
