"""vLLM's serving flag names are accepted as aliases of Strata's (tritonserver-style) engine overrides."""

from __future__ import annotations

import pytest

from server.cli import build_parser, command_options, engine_overrides

COMMANDS = {
    "serve": ["serve", "--model-repository", "repo"],
    "worker": ["worker", "--model-repository", "repo", "--model", "m", "--redis-url", "redis://127.0.0.1:1"],
    "profile": ["profile", "--model-repository", "repo", "--model", "m", "--output", "p.json"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_max_model_len_and_max_num_seqs_are_the_context_length_and_concurrency_overrides(command) -> None:
    parser = build_parser()
    vllm_names = parser.parse_args([*COMMANDS[command], "--max-model-len", "1024", "--max-num-seqs", "8"])
    strata_names = parser.parse_args(
        [*COMMANDS[command], "--context-length", "1024", "--max-concurrent-requests", "8"]
    )
    expected = {"max_model_len": 1024, "max_concurrent_requests": 8}
    overrides = [engine_overrides(command_options(args).engine) for args in (vllm_names, strata_names)]
    assert overrides == [expected, expected]
