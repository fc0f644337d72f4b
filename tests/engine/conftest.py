"""One real SmolLM2 engine (fp32, CPU) and one transformers reference model shared by the engine tests."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from server.engine.api import GenerationRequest, RequestId, SamplingParams
from server.engine.config import EngineConfig
from server.engine.kernels import cpu_kernels
from server.engine.llm_engine import LLMEngine
from server.engine.stream import generate

ROOT = Path(__file__).resolve().parents[2]
MODEL_CACHE = ROOT / ".strata-cache" / "models"  # git-ignored; reused across runs so only the first converts

LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined a "
    "screw press with movable metal type, oil-based ink and a mould for casting letters. Before that, books were "
    "copied by hand in monasteries and workshops, which made them rare and expensive. Within fifty years printing "
    "shops had spread to more than two hundred cities in Europe, and millions of volumes had been produced. "
    "Pamphlets, newspapers and scientific journals followed, and the speed at which ideas travelled changed "
    "forever. Historians still argue about how much the press caused the Reformation, the scientific revolution "
    "and the rise of literacy, but few doubt that it mattered. Printing also standardised spelling and grammar, "
    "because printers wanted texts that sold in many regions. Later inventions such as the steam-powered rotary "
    "press, the linotype machine and offset lithography made printing faster and cheaper still, until the "
    "digital age brought a new revolution of its own. "
)

PROMPTS: list[str | list[dict]] = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a small village by the sea,",
    "Translate to French: I love reading books in the garden.",
    "Le fromage est",
    "Die Hauptstadt von Deutschland ist",
    "東京は日本の首都で、",
    "Emoji story: 🐶🐱🚀🌍 The dog and the cat flew to",
    "Привет! Как дела? Сегодня",
    "¿Dónde está la biblioteca? La biblioteca está",
    LONG_TEXT + "In one sentence, the main effect of printing was",
    LONG_TEXT * 2 + "To summarise the text above:",
    "Write a haiku about autumn leaves.\n",
    "Question: What is 12 times 12?\nAnswer:",
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Give me three tips for sleeping better."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Color of the sky?"},
    ],
    [{"role": "user", "content": "Résume en une phrase: " + LONG_TEXT}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "こんにちは！元気ですか？😊"}],
]
MAX_TOKENS = 16


def engine_config(**overrides) -> EngineConfig:
    base = dict(
        cache_dir=str(MODEL_CACHE), dtype="float32", device="cpu", num_kv_blocks=400, max_model_len=2048,
        max_num_batched_tokens=512, max_tokens_limit=256, num_threads=2,
    )  # fmt: skip
    return EngineConfig(**{**base, **overrides})


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo); empty where there is none."""
    try:
        line = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return set()
    return set(line.split())


@pytest.fixture(scope="session")
def kernels():
    """The compiled CPU kernels module (server/engine/kernels); a test that needs it fails where it did not build."""
    module = cpu_kernels()
    if module is None:
        pytest.fail("the CPU kernels did not build on this machine (see the log)")
    return module


@pytest.fixture(scope="session")
def engine() -> Iterator[LLMEngine]:
    with LLMEngine(engine_config()) as shared:
        yield shared


@pytest.fixture(scope="session")
def hf_model(engine: LLMEngine):
    """transformers' own Llama on the same dequantized weights (the safetensors cache), fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine.files.folder, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def prompt_ids(engine: LLMEngine) -> list[list[int]]:
    return [engine.apply_chat_template(p) if isinstance(p, list) else engine.encode(p) for p in PROMPTS]


@pytest.fixture(scope="session")
def reference_outputs(hf_model, prompt_ids: list[list[int]]) -> list[list[int]]:
    return hf_greedy(hf_model, prompt_ids)


def hf_greedy(hf_model, prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers greedy continuations (do_sample=False), one prompt at a time, stopping at EOS."""
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            result = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=2,
                eos_token_id=2,
            )
            outputs.append(result[0, len(ids) :].tolist())
    return outputs


def greedy(ids: list[int], request_id: str, max_tokens: int = MAX_TOKENS, **sampling) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    return GenerationRequest(RequestId(request_id), list(ids), params)


def run(engine: LLMEngine, request: GenerationRequest):
    return generate(engine, request, timeout=120)


def collect_concurrently(engine: LLMEngine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    """Submit every request before reading any output, so they share steps; return tokens by request id."""
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    for request in requests:
        engine.submit(request, outputs.put)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finished = 0
    while finished < len(requests):
        output = outputs.get(timeout=300)
        assert output.finish_reason != "error", output.error
        tokens[output.request_id].extend(output.new_token_ids)
        finished += output.finished
    return tokens


def watch_steps(engine: LLMEngine) -> list[list[str]]:
    """From now on, the request ids of each step `engine` runs, appended to the list returned (its runner's `run`
    wrapped; for an engine the test owns)."""
    steps: list[list[str]] = []
    forward = engine.runner.run

    def watched(chunks: list) -> torch.Tensor:
        steps.append([chunk.seq.request_id for chunk in chunks])
        return forward(chunks)

    engine.runner.run = watched
    return steps


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Re-check `condition` until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        pause.wait(0.005)
