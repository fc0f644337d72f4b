"""`strata serve --workers 2 --batch-invariant` of SmolLM2 in bf16 (one torch thread per worker): streams in flight
when the worker holding some of them is SIGKILLed go on on the other worker with exactly the text, tokens and
logprobs each request had alone, and the workers (processes) answer as an engine in this process does. Tokens are
compared by their text: the completions API gives no token ids (`return_tokens_as_token_ids` is refused)."""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec
import openai
import pytest

from harness.metrics import samples, scrape
from harness.servers import smollm2_repository, start_strata
from server.engine.api import GenerationRequest, RequestId, SamplingParams
from server.engine.config import EngineConfig
from server.engine.llm_engine import LLMEngine
from server.engine.stream import generate

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a long story about a lighthouse keeper:",
    "The three laws of thermodynamics are",
    "A recipe for bread, step by step:",
    "def quicksort(items):",
    "Les montagnes de la Suisse sont",
    "List the planets of the solar system in order:",
]
MAX_TOKENS = 40


@dataclass(frozen=True)
class Answer:
    """One choice as a client saw it: its text, each token's text and logprob."""

    text: str
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    return smollm2_repository(tmp_path_factory.mktemp("bi-serving"), dtype="bfloat16")


@pytest.fixture(scope="module")
def server(repository):
    process = start_strata(
        repository, repository.parent / "run", "--workers", "2", "--batch-invariant", "--no-kvbm"
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=f"{server.openai_url}/v1", api_key="unused", timeout=120, max_retries=0
    ) as client:
        yield client


@pytest.fixture(scope="module")
def alone(client) -> list[Answer]:
    """Each prompt alone on the server, both workers up."""
    return [read(complete(client, prompt)) for prompt in PROMPTS]


def complete(client: openai.OpenAI, prompt: str):
    """A greedy streamed completion of MAX_TOKENS tokens with each token's logprob."""
    return client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def read(chunks) -> Answer:
    """A choice's streamed chunks put together."""
    choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
    tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
    logprobs = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
    return Answer("".join(c.text for c in choices), tuple(tokens), tuple(logprobs))


def in_flight(server) -> dict[str, float]:
    """strata_router_worker_in_flight by worker id."""
    rows = samples(scrape(server.openai_url), "strata_router_worker_in_flight")
    return {labels["worker"]: value for labels, value in rows}


def test_the_workers_answer_as_an_engine_in_this_process(repository, alone):
    """The engine the workers build (their model.json and the mode), here with this process's torch threads, every
    prompt submitted at once."""
    config = EngineConfig.from_json(repository / "smollm2" / "1" / "model.json")
    config = msgspec.structs.replace(config, batch_invariant=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    with LLMEngine(config) as engine, ThreadPoolExecutor(len(PROMPTS)) as pool:
        requests = [
            GenerationRequest(RequestId(f"local-{i}"), engine.encode(p), params)
            for i, p in enumerate(PROMPTS)
        ]
        outputs = list(pool.map(lambda request: generate(engine, request, timeout=120), requests))
    local = [
        Answer(o.new_text, tuple(lp.token for lp in o.logprobs), tuple(lp.logprob for lp in o.logprobs))
        for o in outputs
    ]
    assert local == alone


def test_streams_of_a_killed_worker_go_on_exactly_as_alone(client, server, alone):
    pids = dict(re.findall(r"worker (\S+) up: pid (\d+)", server.log()))
    streams = [complete(client, prompt) for prompt in PROMPTS]
    seen = [[next(stream) for _ in range(6)] for stream in streams]  # 6 tokens of each, or more, computed
    held = in_flight(server)
    holder = max(held, key=held.get)
    assert sum(held.values()) == len(PROMPTS) and held[holder] >= 1  # all in flight, some on the one killed
    os.kill(int(pids[holder]), signal.SIGKILL)
    answers = [read(first + list(stream)) for first, stream in zip(seen, streams, strict=True)]
    migrated = samples(scrape(server.openai_url), "strata_router_migrations_total")
    assert migrated == [({"worker": holder}, held[holder])]  # each stream it held went on on the other worker
    assert answers == alone
