"""A seeded fuzzer for the LLM model's Triton HTTP endpoints: generate, generate_stream and KServe infer bodies,
`parameters` and `sampling_parameters`, sent to a real `strata serve` with SmolLM2.

Every answer must be a 2xx or a 4xx whose message names what was wrong (never Strata's "internal error", which
would mean a client's mistake reached a code path that did not expect it); the only 5xx allowed are Triton's own
answers to bodies it cannot convert (TRITON_CORE_ERRORS), which never reach Strata. Afterwards Triton and the
model are ready, the engine is healthy, the log has no failed generation and a normal request is answered. The
cases are the same every run (SEED, CASES); a case that fails is printed as the body to replay.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.slow

SEED = 14
CASES = 240
MODEL_PATH = "/v2/models/smollm2"
# Triton 2.51 (PyTriton's tritonserver) answers these itself, before the model sees the request: a body that is not
# JSON, or whose values do not convert to the model's tensors, is a 500 (a 400 in later Triton releases); infer on a
# decoupled model over HTTP is a 501. They are Triton's, not Strata's, so they are counted, not failed.
TRITON_CORE_ERRORS = (
    "failed to parse the request JSON buffer",
    "attempt to access JSON non-",
    "attempt to get members for non-object",
    "HTTP end point doesn't support models with decoupled transaction policy",
)
SAMPLING = {  # field -> (valid values, kept small so that every case stays quick; values to refuse)
    "max_tokens": ([1, 2, 3], [0, -1, 2**31, 2**64, 10**30, 1.5, 2.0, "3", True, [], {}]),
    "temperature": ([0, 0.7, 1, 2.5, 1e-9, 1e30, None], [-1, 1e309, "0", [0], 10**400, 1e39]),
    "top_p": ([0.5, 1, 0.01], [0, -0.1, 1.01, "1"]),
    "top_k": ([0, 1, 50, 10**6], [-1, 2**40, 3.5, "5"]),
    "seed": ([0, 7, -1, 2**63, None], [2**64, -(2**63) - 1, 10**30, 1.25, "7"]),
    "stop": (["\n", ["a", "b"], ["."] * 500, "x" * 5000, "\ud800", None], ["", [""], [1], {}]),
    "stop_token_ids": ([[2], [], None], [[-1], [49152], [2**70], ["2"], 2, [True]]),
    "presence_penalty": ([0, 1.5, -2], [-2.1, 2.1, "1"]),
    "frequency_penalty": ([0, -1.5, 2], [3, False]),
    "ignore_eos": ([True, False, None], [1, "true"]),
    "min_tokens": ([0, 1, 2], [-1, 10**9, 1.0, "1", 5]),  # 5 > every valid max_tokens here
    "cache_salt": (["tenant", "é" * 256, None], ["", "x" * 257, 5, "\ud800"]),
    "bogus_field": ([], [1, "x"]),
}
FLAGS = ["stream", "exclude_input_in_output"] + [
    f"return_{name}"
    for name in ("finish_reason", "num_input_tokens", "num_output_tokens", "num_cached_tokens")
]
WRONG_FLAG_VALUES = [1, 0, "true", None, [True], {}]  # Triton itself refuses these (see TRITON_CORE_ERRORS)
TEXTS = [
    "The capital of France is",
    "",
    " ",
    "日本語のテキスト",
    "emoji 🤖🔥 and zero\u200bwidth",
    "nul \u0000 inside",
    "lone \ud800 surrogate",
    "right-to-left \u202e text",
    "a" * 600_000,  # more characters than any 4096-token context holds: refused before tokenizing
    "word " * 5000,  # tokenized, then longer than the context
    5,
    None,
    ["two", "prompts"],
    {"text": "hi"},
    True,
]


def _sampling(rng: random.Random) -> dict[str, Any]:
    """A few sampling fields, each valid or not; max_tokens small unless it is the field under test."""
    fields: dict[str, Any] = {"max_tokens": rng.choice([1, 2, 3])}
    for name in rng.sample(sorted(SAMPLING), rng.randint(0, 4)):
        valid, wrong = SAMPLING[name]
        fields[name] = rng.choice(valid if valid and rng.random() < 0.75 else wrong)
    return fields


def _generate_body(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"text_input": rng.choice(TEXTS[:5]) if rng.random() < 0.8 else rng.choice(TEXTS)}
    if rng.random() < 0.04:
        del body["text_input"]
    sampling = _sampling(rng)
    where = rng.choice(
        ["parameters", "sampling_parameters", "sampling_parameters", "both"]
    )  # lists: only JSON
    if where in ("parameters", "both"):
        body["parameters"] = sampling
    if where in ("sampling_parameters", "both"):
        broken = ["{not json", "[1, 2]", "7", "", json.dumps("x"), json.dumps(sampling)[:-1]]
        body["sampling_parameters"] = json.dumps(sampling) if rng.random() < 0.8 else rng.choice(broken)
    for flag in rng.sample(FLAGS, rng.randint(0, 3)):
        value = rng.choice([True, False]) if rng.random() < 0.85 else rng.choice(WRONG_FLAG_VALUES)
        if rng.random() < 0.5:
            body[flag] = value
        else:
            body.setdefault("parameters", {})[flag] = value
    return body


def _infer_body(rng: random.Random) -> dict[str, Any]:
    """A KServe v2 infer body (the model is decoupled: Triton itself refuses infer, whatever the inputs)."""
    name = rng.choice(["text_input", "stream", "sampling_parameters", "nope"])
    datatype = rng.choice(["BYTES", "BOOL", "INT32", "FP32", "WHAT"])
    shape = rng.choice([[1], [2], [], [-1], [1, 1], [2**40]])
    data = rng.choice([["hi"], [True], [1, 2], [], "hi", None, [[1]]])
    return {"inputs": [{"name": name, "datatype": datatype, "shape": shape, "data": data}]}


def _raw(body: dict[str, Any]) -> bytes:
    """JSON as Python writes it: NaN and Infinity stay literal tokens, lone surrogates stay escapes."""
    return json.dumps(body).encode()


def fuzz_case(rng: random.Random) -> tuple[str, bytes]:
    """(path, body bytes) of one case."""
    kind = rng.random()
    if kind < 0.55:
        return f"{MODEL_PATH}/generate", _raw(_generate_body(rng))
    if kind < 0.8:
        body = _generate_body(rng)
        body.setdefault("parameters", {})
        if rng.random() < 0.8:
            body["stream"] = True
            body["exclude_input_in_output"] = True
        return f"{MODEL_PATH}/generate_stream", _raw(body)
    if kind < 0.85:
        return f"{MODEL_PATH}/infer", _raw(_infer_body(rng))
    path = rng.choice(
        [f"{MODEL_PATH}/generate", f"{MODEL_PATH}/versions/1/generate", f"{MODEL_PATH}/versions/9/generate"]
    )
    broken: list[Callable[[], bytes]] = [
        lambda: b"",
        lambda: b"{",
        lambda: b'{"text_input": "\xff\xfe", "parameters": {"max_tokens": 1}}',  # not UTF-8
        lambda: b"[" * 50_000 + b"]" * 50_000,
        lambda: b'{"text_input": "hi", "parameters": {"max_tokens": 1, "temperature": NaN}}',
        lambda: b'{"text_input": "hi", "parameters": {"max_tokens": 1}, "text_input": "twice"}',
        lambda: _raw({"text_input": "hi", "parameters": {"max_tokens": 1, "nested": {"a": [1]}}}),
        lambda: b'"just a string"',
    ]
    return path, rng.choice(broken)()


def post_raw(server, path: str, data: bytes) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://{server.http_url}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def get_status(server, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_generate_and_infer_bodies_never_break_the_server(server) -> None:
    rng = random.Random(SEED)
    failures = []
    statuses: dict[str, int] = {}
    for index in range(CASES):
        path, data = fuzz_case(rng)
        status, answer = post_raw(server, path, data)
        triton_core = status >= 500 and any(error in answer for error in TRITON_CORE_ERRORS)
        key = f"{status} (Triton)" if triton_core else str(status)
        statuses[key] = statuses.get(key, 0) + 1
        if (status >= 500 and not triton_core) or "internal error" in answer:
            failures.append(f"case {index}: POST {path} {data[:300]!r} -> {status} {answer[:300]}")
    print(f"{CASES} cases, statuses {dict(sorted(statuses.items()))}")
    assert not failures, "\n".join(failures)
    assert statuses.get("200", 0) >= CASES // 8  # the fuzzer also reaches the engine, not only the validators
    _assert_still_serving(server)


def _assert_still_serving(server) -> None:
    assert server.process.poll() is None
    assert get_status(server, "/v2/health/ready") == 200
    assert get_status(server, f"{MODEL_PATH}/ready") == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{server.openai_port}/health", timeout=30) as response:
        assert json.loads(response.read()) == {"status": "ok"}  # the engine is alive
    body = {"text_input": "The capital of France is", "parameters": {"temperature": 0, "max_tokens": 3}}
    status, answer = post_raw(server, f"{MODEL_PATH}/generate", _raw(body))
    assert status == 200, answer
    assert json.loads(answer)["text_output"].startswith("The capital of France is")
    log = server.log()
    assert "generation failed" not in log and "exited unexpectedly" not in log
