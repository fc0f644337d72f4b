"""bf16 greedy output against transformers in bf16 on the same weights, and both against the fp32 reference.

bf16 sums in another order (fused q/k/v, fp32 norms and attention here, bf16 SDPA in transformers) cannot be
token-identical, so the check is statistical and says where each prompt diverges: concurrent (batched, chunked
prefill of the long prompts), then again with the prompts' blocks cached.
"""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, collect_concurrently, engine_config, greedy, hf_greedy

from server.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def bf16_engine():
    with LLMEngine(engine_config(dtype="bfloat16", max_num_batched_tokens=256)) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf_bf16_outputs(bf16_engine, prompt_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bf16_engine.files.folder, dtype=torch.bfloat16).eval()
    return hf_greedy(model, prompt_ids)


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[float, list[int | None]]:
    """(share of tokens before each prompt's first divergence, first divergence per prompt or None)."""
    same = total = 0
    firsts: list[int | None] = []
    for a, b in zip(ours, theirs, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        firsts.append(first)
        same += len(a) if first is None else first
        total += max(len(a), len(b))
    return same / total, firsts


def test_bf16_tracks_transformers_bf16_and_is_no_further_from_fp32(
    bf16_engine, prompt_ids, hf_bf16_outputs, reference_outputs
):
    for attempt in ("fresh", "cached"):
        tokens = collect_concurrently(
            bf16_engine, [greedy(ids, f"{attempt}-{i}") for i, ids in enumerate(prompt_ids)]
        )
        ours = [tokens[f"{attempt}-{i}"] for i in range(len(prompt_ids))]
        share, firsts = agreement(ours, hf_bf16_outputs)
        ours_vs_fp32, _ = agreement(ours, reference_outputs)
        theirs_vs_fp32, _ = agreement(hf_bf16_outputs, reference_outputs)
        report = (
            f"{attempt}: {share:.1%} of tokens identical to transformers bf16, "
            f"{sum(f is None for f in firsts)}/{len(firsts)} prompts fully; first divergence per prompt {firsts}; "
            f"against fp32: ours {ours_vs_fp32:.1%}, transformers bf16 {theirs_vs_fp32:.1%}"
        )
        print(report)
        assert len(PROMPTS) == len(firsts)
        # measured here (AVX2, no native bf16): 85.8 % identical, 16/22 prompts, earliest divergence at token 1
        assert share >= 0.75, report
        assert sum(f is None for f in firsts) >= len(firsts) // 2, report
        assert ours_vs_fp32 >= theirs_vs_fp32 - 0.05, report
