"""Batch-invariant engines (`batch_invariant`): a request gets the same tokens and the same logprobs, bit for bit,
alone or among 2, 7 or 31 others (all of them in one step at least once), with its prompt prefilled whole or in
chunks of 16 or 48 tokens, with its prefix cached (including a last chunk of one token, which by default takes the
decode kernel), and when it is resumed from its prompt plus the tokens it had (a migration's or a disaggregated
decode's continuation); seeded sampling too.
Real SmolLM2 in bf16 and fp32; the linear layers' row invariance, which the mode relies on, is checked on this CPU.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from conftest import watch_steps

from server.engine import kernels
from server.engine import linear as packed_linear
from server.engine.api import GenerationOutput, GenerationRequest, RequestId, SamplingParams
from server.engine.config import EngineConfig
from server.engine.llm_engine import LLMEngine
from server.engine.stream import generate

pytestmark = pytest.mark.slow
MODEL_CACHE = Path(__file__).resolve().parents[2] / ".strata-cache" / "models"
TEXT = (
    "The history of science is full of surprises, and here is a long account of how instruments changed it. "
)
TOKENS = 10  # each prompt runs alone first (the reference): 32 prompts x 2 dtypes, so tokens cost the suite


def engine(dtype: str, chunk: int = 1024) -> LLMEngine:
    config = EngineConfig(
        cache_dir=str(MODEL_CACHE), dtype=dtype, device="cpu", num_kv_blocks=1024, max_model_len=1024,
        max_num_batched_tokens=chunk, max_tokens_limit=64, num_threads=2, max_concurrent_requests=32,
        batch_invariant=True,
    )  # fmt: skip
    return LLMEngine(config)


def prompts(e: LLMEngine, count: int) -> list[list[int]]:
    """Prompts of 17 to 81 tokens, most of them one past a whole number of blocks (a cached prefix then leaves a
    one-token chunk), the rest of other lengths."""
    found = []
    for i in range(count):
        ids = e.encode(TEXT * (1 + i % 4) + f"Chapter {i}:")
        found.append(ids[: len(ids) // 16 * 16 + 1] if i % 3 else ids)
    return found


def run(e: LLMEngine, prompt: list[int], tag: str, max_tokens: int = TOKENS, **sampling) -> GenerationOutput:
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, logprobs=1, **{"temperature": 0.0, **sampling}
    )
    return generate(e, GenerationRequest(RequestId(tag), list(prompt), params), timeout=600)


def answer(output: GenerationOutput) -> tuple:
    """What the mode keeps the same: the tokens and their logprobs."""
    return tuple(output.new_token_ids), tuple(lp.logprob for lp in output.logprobs)


def together(
    e: LLMEngine, batch: list[list[int]], tag: str, sampling: list[dict] | None = None
) -> tuple[list[tuple], int]:
    """Every prompt submitted at once (`sampling[i]`: prompt i's sampling fields): their answers, and the most of
    them that one step of `e` ran."""
    results: list = [None] * len(batch)
    steps = watch_steps(e)

    def one(i: int) -> None:
        results[i] = answer(run(e, batch[i], f"{tag}-{i}", **(sampling[i] if sampling else {})))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(batch))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, max(len(step) for step in steps)


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def reference(request) -> tuple[str, list[list[int]], list[tuple]]:
    """Each prompt alone on a fresh engine, then the same engine's runs of the cached and continued paths."""
    dtype = request.param
    with engine(dtype) as e:
        batch = prompts(e, 32)
        alone = [answer(run(e, p, f"alone-{i}")) for i, p in enumerate(batch)]
        cached = [run(e, p, f"cached-{i}") for i, p in enumerate(batch[:8])]
        resumed = [
            answer(run(e, p + list(a[0][:7]), f"resumed-{i}", TOKENS - 7))
            for i, (p, a) in enumerate(zip(batch[:8], alone[:8], strict=True))
        ]
    # every full block before the prompt's last token came from the cache
    assert [o.num_cached_tokens for o in cached] == [(len(p) - 1) // 16 * 16 for p in batch[:8]]
    assert [answer(o) for o in cached] == alone[:8], "a cached prefix changed the answer"
    for (tokens, logprobs), (more, more_logprobs) in zip(alone[:8], resumed, strict=True):
        assert (tokens[7:], logprobs[7:]) == (more, more_logprobs), "a continuation is not the original's"
    return dtype, batch, alone


@pytest.mark.parametrize("size", [3, 8, 32])
def test_the_same_tokens_and_logprobs_in_any_batch(reference, size: int) -> None:
    dtype, batch, alone = reference
    with engine(dtype) as e:
        results, widest = together(e, batch[:size], f"batch{size}")
    assert widest == size  # they did share steps
    assert results == alone[:size]


@pytest.mark.parametrize("chunk", [16, 48])
def test_the_same_tokens_and_logprobs_with_the_prompt_in_chunks(reference, chunk: int) -> None:
    dtype, batch, alone = reference
    with engine(dtype, chunk) as e:
        results, widest = together(e, batch[:8], f"chunk{chunk}")
    assert widest == 8
    assert results == alone[:8]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(reference) -> None:
    """Four seeded requests at temperature 1, alone, then submitted together with four unseeded ones and the
    prompt in chunks of 48: the seeded ones draw the same tokens."""
    dtype, batch, _ = reference
    seeded = [{"temperature": 1.0, "seed": 100 + i} for i in range(4)]
    with engine(dtype) as e:
        alone = [answer(run(e, batch[i], f"seed-alone-{i}", **seeded[i])) for i in range(4)]
    with engine(dtype, 48) as e:
        mixed, widest = together(e, batch[:8], "seed-batch", seeded + [{"temperature": 1.0}] * 4)
    assert widest == 8
    assert mixed[:4] == alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(576, 576), (1536, 576), (576, 1536), (49152, 576)]
)
def test_linear_rows_do_not_depend_on_the_row_count(
    dtype: torch.dtype, out_features: int, in_features: int
) -> None:
    """What the mode relies on for the linear layers (SmolLM2's shapes): each row of x W^T is the same bits at
    every row count, with a single row computed as two (`min_rows`, what a batch-invariant model passes: oneDNN
    sums one fp32 row of K = 1536 in another order). A CPU whose GEMM picks its reduction by M fails here."""
    compiled = kernels.cpu_kernels()
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(300, in_features, generator=generator).to(dtype)
    packed = packed_linear.pack(weight, True, compiled)
    single = torch.cat([packed_linear.linear(x[i : i + 1], packed, None, 2) for i in range(20)])
    for rows in (2, 3, 8, 32, 33, 64, 65, 81, 300):
        out = packed_linear.linear(x[:rows], packed, None, 2)
        assert torch.equal(out[: min(rows, 20)], single[: min(rows, 20)]), rows
